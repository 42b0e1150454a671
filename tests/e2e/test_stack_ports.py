"""`rollart up` / `rollart status` when the default Prefect port belongs to someone else.

Another checkout's stack or a user's own `prefect server start` may hold 4200. The probe: a
stale state directory (its server gone) whose recorded port is now another server's made `up`
end in a 131-line traceback (401 from that server, after sending it our auth string), and
`status` report `prefect-server up pid N` for a process that never started. Here a plain
listener plays the other server (health 200, everything else 401) on a free port made the
stack's default through ROLLART_PREFECT_PORT (port 4200 itself may be a colleague's), and:

- `status` says down for every service whose recorded pid is not the one listening on its
  recorded port (a live pid and a healthy answer are not enough), and exits 1;
- `up` starts a server of its own on a free port and says so in one line naming the holder;
  `status` then reports that server, by its pid; an explicit port that is taken fails in one
  line naming who holds it;
- the other server never receives our credentials.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infra.prefect_server import auth_string, requires_auth, start_server
from infra.state import private_dir, write_private

ROOT = Path(__file__).resolve().parents[2]


class _Foreign(BaseHTTPRequestHandler):
    """Someone else's server: open health checks, 401 for everything else."""

    seen: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        _Foreign.seen.append(self.headers.get("Authorization") or "")
        ok = self.path.rstrip("/").endswith("health")
        body = b'{"ok": true}' if ok else b'{"detail": "Unauthorized"}'
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = _answer  # noqa: N815


@pytest.fixture
def foreign(monkeypatch):
    """(port, seen Authorization headers); the port is the stack's default Prefect port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Foreign.seen = []
    port = server.server_address[1]
    monkeypatch.setenv("ROLLART_PREFECT_PORT", str(port))
    yield port, _Foreign.seen
    server.shutdown()
    server.server_close()


@pytest.fixture
def decoy():
    """A live process whose command line has every service's token, listening nowhere."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "prefect",
                             "scheduler", "infra.lambda_endpoint"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _stale_state(state: Path, port: int, pid: int) -> None:
    """What a stack left behind: pid files and ports, now pointing at someone else's port."""
    private_dir(state)
    auth_string(state)
    write_private(state / "prefect.port", str(port))
    for name in ("prefect", "dask-scheduler", "lambda"):
        write_private(state / f"{name}.pid", str(pid))
    services = {"dask-scheduler": {"token": "scheduler"},
                "lambda": {"token": "infra.lambda_endpoint"}}
    write_private(state / "stack.json", json.dumps({
        "classes": {}, "pool": "rollart-local", "services": services,
        "ports": {"prefect": port, "scheduler": port, "dashboard": port, "lambda": port}}))


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["ROLLART_STATE_DIR"] = str(state)
    return subprocess.run([sys.executable, "-m", "cli.stack", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_status_is_down_when_the_recorded_pid_does_not_hold_the_port(tmp_path, foreign, decoy):
    port, seen = foreign
    state = tmp_path / "state"
    _stale_state(state, port, decoy)
    proc = _cli(state, "status", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {s["name"]: s for s in json.loads(proc.stdout)["services"]}
    for name in ("prefect-server", "prefect-worker", "dask-scheduler", "lambda"):
        assert rows[name]["up"] is False, rows[name]
    text = _cli(state, "status")
    assert text.returncode == 1 and f"pid {decoy}" not in text.stdout, text.stdout
    assert not any(seen), "our credentials went to another server"
    # An explicit port that is taken: one line, naming who holds it (here: this test).
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path / "other", port=port)
    assert f"pid {os.getpid()}" in str(info.value) and "\n" not in str(info.value)


def test_up_takes_a_free_port_and_status_reports_our_server(tmp_path, foreign, monkeypatch):
    from typer.testing import CliRunner

    from cli.stack import app
    from infra.stack import Stack

    port, seen = foreign
    state = tmp_path / "state"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _stale_state(state, port, dead.pid)  # the case: our server gone, its port taken
    # Only the Prefect server is at stake here: the other services are stubbed out.
    for method in ("_ensure_s3", "_ensure_dask", "_ensure_lambda", "_ensure_pool_and_worker",
                   "_wait_healthy"):
        monkeypatch.setattr(Stack, method, lambda self, *a, **k: None)
    monkeypatch.setenv("ROLLART_STATE_DIR", str(state))
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["up", "--timeout", "120"])
    stack = Stack(state)
    try:
        assert result.exit_code == 0, result.output
        notes = [line for line in result.output.splitlines()
                 if line.startswith("note: prefect:")]  # (other defaults may be busy too)
        assert len(notes) == 1 and f"port {port} is held by pid {os.getpid()}" in notes[0], \
            result.output
        new_port = stack.prefect_port()
        assert new_port and new_port != port and f"using {new_port}" in notes[0]
        assert stack.api_url == f"http://127.0.0.1:{new_port}/api"
        assert requires_auth(stack.api_url, auth_string(state, create=False))
        rows = {s.name: s for s in stack.status()}
        server_pid = int((state / "prefect.pid").read_text())
        assert rows["prefect-server"].up and rows["prefect-server"].pid == server_pid
        assert not any(seen), "our credentials went to another server"
        assert time.monotonic() - t0 < 120
    finally:
        stack.down()
    assert not stack.prefect_up()
