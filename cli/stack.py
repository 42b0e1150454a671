"""`rollart up | down | status | deploy | submit`: the local stack and the Prefect control plane.

Mounted on the main CLI with `app.add_typer(stack_app)` (commands at the top level). Prefect is
imported lazily, inside the commands that talk to the API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from infra.stack import DEFAULT_POOL as LOCAL_POOL
from infra.stack import PROJECT_ROOT, Stack
from rollart.config import ConfigError, check_overrides, check_run_id

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Local stack and Prefect deployments of rollart.")

FINAL_OK = {"COMPLETED"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
StateDir = typer.Option(None, "--state-dir", envvar="ROLLART_STATE_DIR",
                        help="State directory of the stack (pid files, logs, database)")


def _fail(msg: str, code: int = 2) -> None:
    one_line = "; ".join(line.strip() for line in str(msg).splitlines() if line.strip())
    typer.secho(f"error: {one_line}", fg="red", err=True)
    raise typer.Exit(code)


def _classes(specs: list[str]) -> dict[str, int] | None:
    if not specs:
        return None
    out: dict[str, int] = {}
    for spec in specs:
        name, _, n = spec.partition("=")
        if not name or not (n or "1").isdigit():
            _fail(f"--workers takes CLASS=COUNT, got {spec!r}")
        out[name] = int(n or 1)
    return out


def _print_status(stack: Stack) -> bool:
    rows = stack.status()
    for s in rows:
        mark = typer.style("up  ", fg="green") if s.up else typer.style("down", fg="red")
        extra = ""
        if s.name == "prefect-server":
            extra = (f"  UI {s.extra.get('ui')}  API {s.extra.get('api')}  "
                     f"auth {s.extra.get('auth')}")
        elif s.name == "dask-scheduler":
            extra = (f"  {s.url}  auth {s.extra.get('auth')}  dashboard (read-only, "
                     f"loopback) {s.extra.get('dashboard')}")
        elif s.name == "prefect-worker":
            extra = f"  pool {s.extra.get('pool')} ({s.extra.get('type')})"
        elif s.name == "lambda":
            extra = f"  {s.url or ''}  auth {s.extra.get('auth')}"
        elif s.name.startswith("dask-"):
            res = ",".join(f"{k}={v:g}" for k, v in s.extra.get("resources", {}).items())
            extra = f"  {s.url or ''}  {res}"
        else:
            auth = s.extra.get("auth")
            extra = f"  {s.url or ''}" + (f"  auth {auth}" if auth else "")
        if not s.up:
            extra = ""
        pid = f"pid {s.pid}" if s.pid and s.up else ""
        typer.echo(f"  {s.name:<16} {mark} {pid:<11}{extra}")
    return all(s.up for s in rows)


@app.command()
def up(
    state_dir: Path = StateDir,
    workers: list[str] = typer.Option([], "--workers",
                                      help="CLASS=COUNT Dask workers (default H800=1 H20=1 CPU=1)"),
    free_ports: bool = typer.Option(False, "--free-ports",
                                    help="OS-assigned ports instead of 4200/8786/8787/9001"),
    poll_seconds: float = typer.Option(5.0, "--poll-seconds", help="Worker polling interval"),
    timeout: float = typer.Option(120.0, "--timeout"),
) -> None:
    """Start (or reuse) the local stack: Prefect server + process worker, Dask scheduler and
    hardware-class workers, local Lambda endpoint (and S3 when available). Idempotent."""
    stack = Stack(state_dir, free_ports=free_ports, classes=_classes(workers),
                  poll_seconds=poll_seconds)
    typer.echo(f"Starting the rollart stack (state in {stack.state}) ...")
    try:
        stack.up(timeout=timeout)
    except (RuntimeError, TimeoutError) as err:
        _fail(str(err), 1)
    except OSError as err:  # an HTTP or socket error from a service: one line, no traceback
        _fail(f"{type(err).__name__}: {err}", 1)
    finally:
        for note in stack.notes:  # e.g. a default port someone else holds, and what we took
            typer.echo(f"note: {note}")
    _print_status(stack)
    _register_s3_blocks(stack, state_dir)
    typer.echo(f"\nPrefect UI: {stack.ui_url}    next: rollart deploy")


def _register_s3_blocks(stack: Stack, state_dir: Path | None) -> None:
    """The stack's S3 server as prefect-aws blocks (aws-credentials/local-s3, s3-bucket/local)
    on the stack's Prefect server, for flows and users to load. Skipped without a local S3 or
    when PREFECT_API_URL names another server; a failure is a note, the stack is up anyway."""
    h = stack.s3()
    if h is None or os.environ.get("PREFECT_API_URL") not in (None, "", stack.api_url):
        return
    try:
        _api_url(state_dir)
        from blocks.registration import register_s3_blocks

        _, saved = register_s3_blocks({"bucket": h.bucket, "endpoint_url": h.endpoint_url,
                                       "access_key_id": h.access_key,
                                       "secret_access_key": h.secret_key})
    except Exception as err:  # noqa: BLE001 - any API error: one line, never a key
        typer.echo(f"note: S3 blocks not registered ({type(err).__name__}); "
                   "`rollart deploy` registers them")
        return
    typer.echo("blocks: " + ", ".join(saved))


@app.command()
def down(state_dir: Path = StateDir) -> None:
    """Stop every service of the stack (by PID, from the state directory)."""
    stack = Stack(state_dir)
    stopped = stack.down()
    typer.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@app.command()
def status(
    state_dir: Path = StateDir,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
) -> None:
    """Each service, its PID and URL (Prefect UI, Dask dashboard, ...). Exit 1 if any is down."""
    stack = Stack(state_dir)
    if as_json:
        info = stack.status_json()
        typer.echo(json.dumps(info, indent=2))
        ok = all(s["up"] for s in info["services"])
    else:
        typer.echo(f"rollart stack ({stack.state})")
        ok = _print_status(stack)
    raise typer.Exit(0 if ok else 1)


def _api_url(state_dir: Path | None) -> str:
    """PREFECT_API_URL when set, else the stack's server. Exported for the Prefect client."""
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        stack = Stack(state_dir)
        if not stack.prefect_up():  # ours only, never a server that took our recorded port
            _fail("no Prefect API: run `rollart up` first, or set PREFECT_API_URL", 2)
        api = stack.api_url or ""
        os.environ["PREFECT_API_URL"] = api
        os.environ.setdefault("PREFECT_HOME", str(stack.state / "prefect-home"))
    stack = Stack(state_dir)
    if api == stack.api_url and not os.environ.get("PREFECT_API_AUTH_STRING"):
        from infra.prefect_server import auth_string

        auth = auth_string(stack.state, create=False)  # the stack's server requires it
        if auth:
            os.environ["PREFECT_API_AUTH_STRING"] = auth
    return api


@app.command()
def deploy(
    state_dir: Path = StateDir,
    storage_root: str = typer.Option(None, "--storage-root",
                                     help="Local directory for the `local` storage block "
                                          "(default: the stack's S3 bucket, else ./artifacts)"),
    set_: list[str] = typer.Option([], "--set", help="key.path=value baked into the default "
                                   "`overrides` of the train deployments (repeatable)"),
    prefect_file: Path = typer.Option(PROJECT_ROOT / "prefect.yaml", "--prefect-file"),
) -> None:
    """Register the block types and the stack's block documents, then every deployment of
    prefect.yaml on the local work pool (`train-k8s` needs the Kubernetes pool: README)."""
    _check_overrides(list(set_))
    import yaml

    local = [d["name"] for d in yaml.safe_load(prefect_file.read_text())["deployments"]
             if d["work_pool"]["name"] == LOCAL_POOL]
    api = _api_url(state_dir)
    from blocks.registration import register_local_blocks

    stack = Stack(state_dir)
    ours = os.environ.get("PREFECT_API_URL") == stack.api_url
    info = stack.status_json() if ours else {}
    h = stack.s3() if ours and not storage_root else None
    s3 = None if h is None else {"bucket": h.bucket, "endpoint_url": h.endpoint_url,
                                 "access_key_id": h.access_key, "secret_access_key": h.secret_key}
    saved = register_local_blocks(info, storage_root=storage_root, s3=s3,
                                  lambda_credentials=stack.lambda_credentials() if ours else None)
    typer.echo("blocks: " + ", ".join(saved))
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("prefect")), "deploy", "--no-prompt",
         *[a for name in local for a in ("--name", name)], "--prefect-file", str(prefect_file)],
        cwd=prefect_file.parent, env={**os.environ, "PREFECT_API_URL": api},
        capture_output=True, text=True)
    if proc.returncode != 0:
        typer.echo(proc.stdout[-4000:] + proc.stderr[-4000:], err=True)
        _fail("prefect deploy failed (output above)", 1)
    from prefect import get_client

    names = set(local)
    with get_client(sync_client=True) as client:
        deps = [d for d in client.read_deployments() if d.name in names]
        flows = {f.id: f.name for f in client.read_flows()}
        for d in deps:
            if set_ and flows.get(d.flow_id) == "train":
                from prefect.client.schemas.actions import DeploymentUpdate

                params = {**d.parameters,
                          "overrides": list(d.parameters.get("overrides") or []) + list(set_)}
                client.update_deployment(d.id, DeploymentUpdate(parameters=params))
            sched = ", ".join(getattr(s.schedule, "cron", "") or "schedule" for s in d.schedules)
            typer.echo(f"deployment {flows.get(d.flow_id)}/{d.name}  pool {d.work_pool_name}"
                       + (f"  schedule {sched}" if sched else ""))
    typer.echo(f"Run one: rollart submit --deployment train --wait   (UI: "
               f"{api.removesuffix('/api')}/deployments)")


def _parse_params(params: list[str], sets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in params:
        key, eq, raw = p.partition("=")
        if not eq or not key:
            _fail(f"--param takes KEY=VALUE (VALUE is JSON, else a string), got {p!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    if sets:
        out["overrides"] = list(out.get("overrides") or []) + list(sets)
    _check_overrides(out.get("overrides") or [])
    for key in ("run_id", "resume"):
        if out.get(key) is not None:
            try:
                check_run_id(out[key], key)
            except ConfigError as err:
                _fail(str(err))
    return out


def _check_overrides(overrides: list[str]) -> None:
    """`--set` values go to a deployment run as they are: check what can be checked without
    its config (form, YAML, finite numbers) here, one line and exit 2; the run checks the rest
    before anything starts."""
    if not isinstance(overrides, list):
        _fail("overrides must be a list of key.path=value strings")
    try:
        check_overrides(overrides)
    except ConfigError as err:
        _fail(str(err))


def _resolve_deployment(client: Any, name: str) -> str:
    if "/" in name:
        return name
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    deps = client.read_deployments(
        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])))
    flows = {f.id: f.name for f in client.read_flows()}
    full = sorted({f"{flows.get(d.flow_id)}/{d.name}" for d in deps})
    if len(full) != 1:
        _fail(f"deployment {name!r} " + (f"is ambiguous: {full}" if full else
                                         "not found; run `rollart deploy`"))
    return full[0]


blocks_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Block documents of rollart on the Prefect API.")
app.add_typer(blocks_app, name="blocks")


@blocks_app.command("migrate")
def blocks_migrate(
    state_dir: Path = StateDir,
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would change"),
) -> None:
    """Move the keys of rollart-storage and rollart-lambda-rewards documents into prefect-aws
    AwsCredentials documents (NAME-s3, NAME-lambda) that they then reference. Documents with
    their own keys keep working without this."""
    _api_url(state_dir)
    from blocks.migrate import migrate_documents

    lines = migrate_documents(dry_run=dry_run)
    for line in lines:
        typer.echo(line)
    if not lines:
        typer.echo("nothing to migrate: no document holds keys of its own")


@app.command()
def submit(
    deployment: str = typer.Option(..., "--deployment", "-d",
                                   help="Deployment name (train, evaluate, ...) or FLOW/NAME"),
    param: list[str] = typer.Option([], "--param", "-p", help="KEY=VALUE flow parameter; VALUE "
                                    "is JSON (e.g. overrides='[\"iterations=2\"]') or a string"),
    set_: list[str] = typer.Option([], "--set", help="key.path=value appended to `overrides`"),
    wait: bool = typer.Option(False, "--wait", help="Stream state until the run ends; exit "
                              "non-zero unless it completes"),
    logs: bool = typer.Option(False, "--logs", help="With --wait: stream the run's logs too"),
    timeout: float = typer.Option(0, "--timeout", help="With --wait: give up after N s (exit 3)"),
    run_name: str = typer.Option(None, "--name", help="Flow run name"),
    state_dir: Path = StateDir,
) -> None:
    """Start a deployment run through the Prefect API (from CI, a terminal, a script)."""
    params = _parse_params(param, set_)  # bad input fails before any server is asked
    api = _api_url(state_dir)
    from prefect import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        full = _resolve_deployment(client, deployment)
    fr = run_deployment(full, parameters=params, timeout=0, as_subflow=False,
                        flow_run_name=run_name)
    url = f"{api.removesuffix('/api')}/runs/flow-run/{fr.id}"
    typer.echo(f"flow run {fr.name} ({full}): {url}")
    if not wait:
        return
    code = _follow(fr.id, logs, timeout)
    typer.echo(f"flow run: {url}")
    raise typer.Exit(code)


def _follow(flow_run_id: Any, logs: bool, timeout: float, poll: float = 1.0) -> int:
    """Print each state change (and logs) until a final state. 0 for Completed, 1 otherwise,
    3 on timeout (the run keeps going)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        LogFilter,
        LogFilterFlowRunId,
        LogFilterTimestamp,
    )

    deadline = time.monotonic() + timeout if timeout else None
    last_state, since = None, None
    with get_client(sync_client=True) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            state = fr.state
            if logs:
                flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
                if since is not None:
                    flt.timestamp = LogFilterTimestamp(after_=since)
                for rec in client.read_logs(flt, limit=200):
                    if since is None or rec.timestamp > since:
                        typer.echo(f"    | {rec.message}")
                        since = rec.timestamp
            if state and state.name != last_state:
                last_state = state.name
                stamp = time.strftime("%H:%M:%S")
                msg = f" - {state.message}" if state.message and state.is_final() else ""
                color = "green" if state.type.value in FINAL_OK else (
                    "red" if state.type.value in FINAL else None)
                typer.secho(f"{stamp} {state.name}{msg}", fg=color)
            if state and state.type.value in FINAL:
                return 0 if state.type.value in FINAL_OK else 1
            if deadline and time.monotonic() > deadline:
                typer.secho(f"timed out after {timeout:.0f}s; the run goes on", fg="yellow")
                return 3
            time.sleep(poll)


if __name__ == "__main__":  # `python -m cli.stack ...`
    app()
