"""`rollart` console script (typer). Prefect is imported lazily, only by commands that run flows."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from cli.k8s import app as k8s_app
from cli.lambda_cmd import app as lambda_app
from cli.models import app as models_app
from cli.stack import app as stack_app
from rollart.config import ConfigError, check_run_id, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Agentic RL on disaggregated hardware (Prefect + Dask).")
app.add_typer(lambda_app, name="lambda")
app.add_typer(k8s_app, name="k8s")  # rollart k8s render
app.add_typer(models_app, name="models")  # rollart models fetch NAME
app.add_typer(stack_app)  # rollart up / down / status / deploy / submit


def _fail(msg: str, code: int = 2) -> None:
    one_line = "; ".join(line.strip() for line in str(msg).splitlines() if line.strip())
    typer.secho(f"error: {one_line}", fg="red", err=True)
    raise typer.Exit(code)


def _ensure_prefect_api() -> str | None:
    """Use PREFECT_API_URL if set; otherwise start (or reuse) the local server. Returns UI URL."""
    from infra.prefect_server import auth_for, start_server

    if os.environ.get("PREFECT_API_URL"):
        api = os.environ["PREFECT_API_URL"]
        auth = None if os.environ.get("PREFECT_API_AUTH_STRING") else auth_for(api)
        if auth:  # our own server (it requires basic auth): the state dir holds the secret
            os.environ["PREFECT_API_AUTH_STRING"] = auth
        return api.removesuffix("/api")

    typer.echo("Starting the local Prefect server (reused by later runs) ...")
    server = start_server()
    os.environ.update(server.client_env())  # URL and basic auth (never printed)
    return server.ui_url


def _share_stack_lambda_keys() -> None:
    """On an existing cluster (`--scheduler`, e.g. the stack's), the run's embedded Lambda
    endpoint takes the stack's key pair, which the stack's workers sign with, when this
    environment names none."""
    from infra.stack import default_state_dir
    from infra.state import lambda_credentials
    from rollart.rewards.client import LambdaCredentials

    if LambdaCredentials.from_env() is None:
        creds = lambda_credentials(default_state_dir(), create=False)
        if creds is not None:
            os.environ.update(creds.env())


def _hold_checkpoint_key() -> None:
    """The run signs and verifies its checkpoints with this user's key (the state directory's,
    unless ROLLART_CHECKPOINT_KEY names one): the flow holds it out of the environment and
    gives it to the trainer and engine workers only (rollart/secrets.py). Never printed."""
    from infra.stack import default_state_dir
    from infra.state import checkpoint_key
    from rollart.secrets import CHECKPOINT_KEY_VAR, CheckpointKeyError

    if os.environ.get(CHECKPOINT_KEY_VAR):
        return
    try:
        key = checkpoint_key(default_state_dir())
    except CheckpointKeyError as err:
        _fail(str(err))
    if key:
        os.environ[CHECKPOINT_KEY_VAR] = key


@app.command()
def check_config(
    config: Path = typer.Option(Path("configs/default.yaml"), "--config", "-c"),
    set_: list[str] = typer.Option([], "--set", help="Override: key.path=value (repeatable)"),
) -> None:
    """Validate a config (and overrides) without starting anything."""
    try:
        cfg = load_config(config, set_)
    except ConfigError as err:
        _fail(str(err))
    typer.echo(f"ok: {config} ({cfg.name}, {cfg.iterations} iterations)")


@app.command()
def train(
    config: Path = typer.Option(Path("configs/default.yaml"), "--config", "-c"),
    set_: list[str] = typer.Option([], "--set", help="Override: key.path=value (repeatable)"),
    scheduler: str = typer.Option(None, "--scheduler", help="Existing Dask scheduler address"),
    run_id: str = typer.Option(None, "--run-id", help="Name of the run (default: name-time)"),
    resume: str = typer.Option(None, "--resume", metavar="RUN_ID",
                               help="Continue RUN_ID from its latest complete checkpoint"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Prefect's task logs too"),
) -> None:
    """Run a training flow on the embedded default (or an existing Dask scheduler)."""
    try:
        cfg = load_config(config, set_)  # before any server or cluster starts
        for what, value in (("--run-id", run_id), ("--resume", resume)):
            if value is not None:
                check_run_id(value, what)
    except ConfigError as err:
        _fail(str(err))
    if scheduler:
        _share_stack_lambda_keys()
    ui = _ensure_prefect_api()
    _hold_checkpoint_key()  # after the server started: it does not inherit the key
    if not verbose:  # every log still reaches the Prefect UI; the terminal shows the table
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    from flows.train import new_run_id
    from flows.train import train as train_flow
    from rollart.runner import progress

    run_id = run_id or resume or new_run_id(cfg.name)
    typer.echo(f"Run {run_id}: {cfg.iterations} iterations, "
               f"{cfg.rollout.num_groups}x{cfg.rollout.group_size} episodes per iteration")
    typer.echo(f"Watch it in the Prefect UI: {ui}/runs")
    progress.install(progress.TerminalTable(cfg.iterations))
    state = train_flow(config=str(config), overrides=list(set_), scheduler_address=scheduler,
                       run_id=run_id, resume=resume, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    if not state.is_completed():
        typer.secho(f"Run failed: {state.message}", fg="red", err=True)
        typer.echo(f"Flow run: {ui}/runs/flow-run/{flow_run_id}")
        raise typer.Exit(1)
    out = state.result()
    m = out["final_metrics"]
    typer.secho(f"\nDone: {out['run_id']}", fg="green", bold=True)
    typer.echo(f"  final success rate (train) {m.get('rollout/success_rate', 0):.2f}, "
               f"greedy eval {m.get('eval/success_rate', float('nan')):.2f}")
    typer.echo(f"  checkpoint: {out['checkpoint']}")
    typer.echo(f"  metrics:    {out['store']}/metrics.jsonl")
    typer.echo(f"  flow run:   {ui}/runs/flow-run/{flow_run_id}")


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
