"""The stack's Prefect server, attacked from loopback as issue 16's probes did.

- Without credentials (or with wrong ones) every API call is 401: reading block documents with
  `include_secrets` (the S3 key pair), creating flow runs. Only GET /api/health is open.
- CORS: a foreign `Origin` gets no `Access-Control-Allow-Origin` (the default was `*`).
- A flow run (or a deployment) of the stack's work pool that sets `job_variables.command`,
  an `env` with LD_PRELOAD / PYTHONSTARTUP, or a `working_dir` is refused by the server (422),
  and the job configuration a worker would render has no command from the request either.
- prefect.db (which holds the key that decrypts block secrets) and the auth file are 0600, and
  the auth string appears in no log.
"""

from __future__ import annotations

import json
import os
import stat
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
