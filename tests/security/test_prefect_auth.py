"""The stack's Prefect server, attacked from loopback as issue 16's probes did.

- Without credentials (or with wrong ones) every API call is 401: reading block documents with
  `include_secrets` (the S3 key pair), creating flow runs. Only GET /api/health is open.
- CORS: a foreign `Origin` gets no `Access-Control-Allow-Origin` (the default was `*`).
- A flow run (or a deployment) of the stack's work pool that sets `job_variables.command`,
  an `env` with LD_PRELOAD / PYTHONSTARTUP, or a `working_dir` is refused by the server (422),
  and the job configuration a worker would render has no command from the request either.
- prefect.db (which holds the key that decrypts block secrets) and the auth file are 0600, and
  the auth string appears in no log.
- What the server lets through (a PATCHed deployment's pull steps, a SCHEDULED run posted with
  any job variables) the stack's worker (infra/prefect_worker.py) refuses before anything runs.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra.prefect_server import (
    auth_string,
    basic_auth_header,
    free_port,
    locked_job_template,
    start_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("prefect-auth-state")
    srv = start_server(state_dir=state, port=free_port())
    try:
        yield srv, state
    finally:
        srv.stop()


def _call(url: str, body: object = None, headers: dict[str, str] | None = None,
          method: str | None = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_api_requires_basic_auth(server):
    srv, state = server
    api = srv.api_url
    auth = auth_string(state, create=False)
    assert auth and srv.auth == auth and auth.startswith("rollart:") and len(auth) > 40
    good = basic_auth_header(auth)
    wrong = basic_auth_header("rollart:" + "x" * 43)
    probes = [("/block_documents/filter", {"include_secrets": True}),
              ("/flow_runs/filter", {}), ("/admin/version", None)]
    for path, body in probes:
        for hdrs in ({}, wrong, {"Authorization": "Bearer " + auth}):
            code, _, text = _call(f"{api}{path}", body, hdrs)
            assert code == 401, (path, hdrs, code, text[:200])
        assert _call(f"{api}{path}", body, good)[0] == 200, path
    assert _call(f"{api}/health")[0] == 200  # liveness stays open (status checks use it)
    # a browser-style request (text/plain, foreign Origin) is refused the same way
    code, _, _ = _call(f"{api}/flow_runs/", {"flow_id": "x"},
                       {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert code == 401


def test_cors_is_not_wildcard(server):
    srv, _ = server
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    _, headers, _ = _call(f"{srv.api_url}/flow_runs/filter", headers=pre, method="OPTIONS")
    allow = {k.lower(): v for k, v in headers.items()}.get("access-control-allow-origin")
    assert allow in (None, "") or allow not in ("*", "http://evil.example"), headers
    own = {**pre, "Origin": srv.ui_url}
    _, headers, _ = _call(f"{srv.api_url}/flow_runs/filter", headers=own, method="OPTIONS")
    assert {k.lower(): v for k, v in headers.items()}.get(
        "access-control-allow-origin") == srv.ui_url


def test_state_files_private_and_secret_not_logged(server):
    srv, state = server
    assert stat.S_IMODE(Path(state, "prefect-auth").stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(state, "prefect.db").stat().st_mode) == 0o600
    token = srv.auth.split(":", 1)[1]
    for f in Path(state).rglob("*.log"):
        assert token not in f.read_text(errors="replace"), f
    assert token not in repr(srv)


@pytest.fixture(scope="module")
def deployment(server):
    """A deployment on a work pool with the stack's locked job template (infra/stack.py)."""
    srv, state = server
    api, hdrs = srv.api_url, basic_auth_header(srv.auth)
    pool = "rollart-locked-test"
    code, _, text = _call(f"{api}/work_pools/", {"name": pool, "type": "process",
                                                  "base_job_template": locked_job_template()},
                          hdrs)
    assert code in (200, 201), text
    code, _, text = _call(f"{api}/flows/", {"name": "train"}, hdrs)
    flow_id = json.loads(text)["id"]
    code, _, text = _call(f"{api}/deployments/", {
        "name": "train", "flow_id": flow_id, "work_pool_name": pool,
        "job_variables": {"env": {"OMP_NUM_THREADS": "1"}}}, hdrs)
    assert code in (200, 201), text
    return api, hdrs, json.loads(text)["id"], flow_id, pool, srv


EVIL = [{"command": "touch /tmp/rollart-pwned"},
        {"env": {"LD_PRELOAD": "/tmp/evil.so"}},
        {"env": {"PYTHONSTARTUP": "/tmp/evil.py"}},
        {"working_dir": "/tmp/attacker"},
        {"env": {"OMP_NUM_THREADS": "1; touch /tmp/x"}}]


@pytest.mark.parametrize("job_variables", EVIL)
def test_flow_run_cannot_choose_what_the_worker_executes(deployment, job_variables):
    api, hdrs, dep_id, *_ = deployment
    code, _, text = _call(f"{api}/deployments/{dep_id}/create_flow_run",
                          {"job_variables": job_variables}, hdrs)
    assert code == 422, (code, text[:300])


def test_deployment_cannot_choose_the_command_either(deployment):
    api, hdrs, _, flow_id, pool, _ = deployment
    code, _, text = _call(f"{api}/deployments/", {
        "name": "evil", "flow_id": flow_id, "work_pool_name": pool,
        "job_variables": {"command": "sh -c 'id > /tmp/pwned'"}}, hdrs)
    assert code == 422, (code, text[:300])


def test_allowed_variables_still_work_and_render_no_command(deployment):
    api, hdrs, dep_id, *_ = deployment
    code, _, text = _call(f"{api}/deployments/{dep_id}/create_flow_run",
                          {"job_variables": {"env": {"OMP_NUM_THREADS": "2"}}}, hdrs)
    assert code in (200, 201), text
    import asyncio

    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessJobConfiguration

    # What the process worker renders from the template, even if a request's variables got
    # past the schema: the template has no placeholder for command or working_dir.
    srv = deployment[5]
    with temporary_settings({PREFECT_API_URL: srv.api_url, PREFECT_API_AUTH_STRING: srv.auth}):
        cfg = asyncio.run(ProcessJobConfiguration.from_template_and_values(
            locked_job_template(), {"command": "touch /tmp/x", "working_dir": "/tmp/attacker",
                                    "env": {"OMP_NUM_THREADS": "2"}}))
    assert cfg.command is None and cfg.working_dir is None
    assert cfg.env.get("OMP_NUM_THREADS") == "2"


def test_stack_locks_an_existing_open_pool(server, tmp_path):
    """`rollart up` on a stack whose pool has Prefect's default (open) template replaces it."""
    from prefect.workers.process import ProcessWorker

    from infra.stack import Stack

    srv, state = server
    hdrs = basic_auth_header(srv.auth)
    name = "rollart-old-pool"
    code, _, text = _call(f"{srv.api_url}/work_pools/", {
        "name": name, "type": "process",
        "base_job_template": ProcessWorker.get_default_base_job_template()}, hdrs)
    assert code in (200, 201), text
    s = Stack(state, pool=name)
    s.running = lambda svc: True  # type: ignore[method-assign]  # no worker process needed here
    s._ensure_pool_and_worker(os.environ.copy())
    _, _, text = _call(f"{srv.api_url}/work_pools/{name}", headers=hdrs)
    assert json.loads(text)["base_job_template"] == locked_job_template()


# ---- the stack's worker (infra/prefect_worker.py) -------------------------------------------
# The server does not check everything: PATCH /deployments/{id} stores any job variables, pull
# steps and entrypoint (204), and POST /flow_runs/ with a work pool and a SCHEDULED state takes
# any job variables. The stack's worker checks each run before its process starts.

def _dep(**kw):
    from types import SimpleNamespace

    base = {"job_variables": {"env": {"OMP_NUM_THREADS": "1"}}, "entrypoint": "flows.train:train",
            "storage_document_id": None, "pull_steps": [
                {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]}
    return SimpleNamespace(**{**base, **kw})


ROOT = Path(__file__).resolve().parents[2]
SHELL_STEP = {"prefect.deployments.steps.run_shell_script": {"script": "touch /tmp/pwned"}}


@pytest.mark.parametrize("what, deployment, run_vars", [
    ("command", _dep(job_variables={"command": "touch /tmp/pwned"}), {}),
    ("env", _dep(job_variables={"env": {"LD_PRELOAD": "/tmp/evil.so"}}), {}),
    ("run env", _dep(), {"env": {"PYTHONPATH": "/tmp/attacker"}}),
    ("working_dir", _dep(), {"working_dir": "/tmp/attacker"}),
    ("shell pull step", _dep(pull_steps=[SHELL_STEP]), {}),
    ("git clone", _dep(pull_steps=[{"prefect.deployments.steps.git_clone": {
        "repository": "https://example.invalid/evil.git"}}]), {}),
    ("any callable", _dep(pull_steps=[{"subprocess.getoutput": {"cmd": "id"}}]), {}),
    ("other directory", _dep(pull_steps=[{"prefect.deployments.steps.set_working_directory": {
        "directory": "/tmp/attacker"}}]), {}),
    ("file entrypoint", _dep(entrypoint="/tmp/evil.py:flow"), {}),
    ("storage block", _dep(storage_document_id="9b1e0000-0000-0000-0000-000000000000"), {}),
    ("no deployment", None, {}),
])
def test_worker_rules_refuse(what, deployment, run_vars, monkeypatch):
    from types import SimpleNamespace

    from infra.prefect_worker import RunRefused, check_run

    monkeypatch.delenv("ROLLART_WORKER_ALLOW_PULL_STEPS", raising=False)
    with pytest.raises(RunRefused):
        check_run(SimpleNamespace(job_variables=run_vars), deployment, locked_job_template())


def test_worker_rules_allow_the_stacks_own_deployments_and_the_operators_choice(monkeypatch):
    from types import SimpleNamespace

    from infra.prefect_worker import RunRefused, check_run

    monkeypatch.delenv("ROLLART_WORKER_ALLOW_PULL_STEPS", raising=False)
    run = SimpleNamespace(job_variables={"env": {"OMP_NUM_THREADS": "2"}})
    check_run(run, _dep(), locked_job_template())  # what `rollart deploy` makes
    with pytest.raises(RunRefused, match="template"):  # a pool someone re-opened
        check_run(run, _dep(), {**locked_job_template(), "job_configuration": {
            "command": "{{ command }}"}})
    monkeypatch.setenv("ROLLART_WORKER_ALLOW_PULL_STEPS", "1")  # the operator trusts them
    check_run(run, _dep(pull_steps=[SHELL_STEP], entrypoint="/srv/flows.py:f"),
              locked_job_template())
    with pytest.raises(RunRefused, match="job variables"):  # never the job variables
        check_run(SimpleNamespace(job_variables={"command": "x"}), _dep(), locked_job_template())


def _wait_final(api: str, hdrs: dict[str, str], run_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = json.loads(_call(f"{api}/flow_runs/{run_id}", headers=hdrs)[2])
        state = run.get("state") or {}
        if state.get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        assert time.monotonic() < deadline, f"flow run still {state.get('type')}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def guarded_worker(deployment, tmp_path_factory):
    """The stack's worker (`python -m infra.prefect_worker`) polling the locked test pool."""
    api, hdrs, dep_id, flow_id, pool, srv = deployment
    home = tmp_path_factory.mktemp("worker-home")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k != "ROLLART_WORKER_ALLOW_PULL_STEPS"}
    env.update(srv.client_env(), PREFECT_HOME=str(home), PREFECT_WORKER_QUERY_SECONDS="1")
    proc = subprocess.Popen([sys.executable, "-m", "infra.prefect_worker", "--pool", pool,
                             "--name", "guarded-test"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()  # it started no flow-run process: nothing to wind down
        proc.wait(timeout=15)


def test_worker_refuses_what_the_server_let_through(deployment, guarded_worker, tmp_path):
    api, hdrs, dep_id, flow_id, pool, _ = deployment
    hook = tmp_path / "hook"
    hook.mkdir()
    marker, pulled = tmp_path / "PWNED-STARTUP", tmp_path / "PWNED-PULL"
    (hook / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    # 1. PATCH a deployment's pull steps to a shell command: stored (204), then run.
    code, _, text = _call(f"{api}/deployments/", {
        "name": "patched", "flow_id": flow_id, "work_pool_name": pool,
        "entrypoint": "flows.train:train", "pull_steps": [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]},
        hdrs)
    patched = json.loads(text)["id"]
    code, _, _ = _call(f"{api}/deployments/{patched}", {"pull_steps": [
        {"prefect.deployments.steps.run_shell_script": {"script": f"touch {pulled}"}}]},
        hdrs, method="PATCH")
    assert code == 204  # what Prefect 3.9.1 does: no check on PATCH
    code, _, text = _call(f"{api}/deployments/{patched}/create_flow_run", {}, hdrs)
    assert code in (200, 201), text
    shell_run = json.loads(text)["id"]
    # 2. A scheduled run with any environment, straight through POST /flow_runs/.
    code, _, text = _call(f"{api}/flow_runs/", {
        "flow_id": flow_id, "deployment_id": dep_id, "work_pool_name": pool,
        "work_queue_name": "default", "state": {"type": "SCHEDULED"},
        "job_variables": {"env": {"PYTHONPATH": str(hook)}}}, hdrs)
    assert code in (200, 201), text  # the server takes it
    env_run = json.loads(text)["id"]
    for run_id, why in ((shell_run, "pull step"), (env_run, "job variables")):
        state = _wait_final(api, hdrs, run_id)
        assert state["type"] == "CRASHED" and "RunRefused" in (state.get("message") or ""), \
            state
        assert why in state["message"], state
    assert not marker.exists() and not pulled.exists()
