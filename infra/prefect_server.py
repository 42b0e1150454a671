"""Standalone local Prefect server (SQLite), started once and reused by later runs.

A standalone `prefect server start` keeps history (the ephemeral server loses the last task events
on exit) and gives the Dask worker processes an API URL to report task runs to. State (pid file,
log, database) lives under one directory, loopback only.

Loopback is reachable by every local user and by web pages in a local browser, and the API can
read block secrets (`include_secrets`) and start flow runs. So the server requires HTTP basic
auth on every API call (Prefect's `PREFECT_SERVER_API_AUTH_STRING`; only GET /api/health and
/api/ready are open), with a random `rollart:<token>` kept in `<state>/prefect-auth` (0600);
clients send it as `PREFECT_API_AUTH_STRING` (`PrefectServer.client_env()`). CORS allows only
the server's own UI origin, not `*`.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.state import PRIVATE_UMASK, append_private, private_dir, write_private

DEFAULT_STATE_DIR = Path(os.environ.get("ROLLART_STATE_DIR", ".rollart"))
DEFAULT_PORT = 4200
PORT_ENV = "ROLLART_PREFECT_PORT"  # the default port instead of 4200 (tests hold their own)
AUTH_FILE = "prefect-auth"


def default_port() -> int:
    """4200, or $ROLLART_PREFECT_PORT: the port a server of ours takes when it is free."""
    return int(os.environ.get(PORT_ENV) or DEFAULT_PORT)


def _recorded(state: Path) -> tuple[int | None, int | None]:
    """(pid, port) of the server this state directory last started, if recorded."""
    try:
        return int((state / "prefect.pid").read_text()), int((state / "prefect.port").read_text())
    except (OSError, ValueError):
        return None, None


def ours(state_dir: Path | str) -> str | None:
    """The API URL of this state directory's server when it is up and really ours: the
    recorded pid alive *and* the one listening on the recorded port. A record alone is not
    enough: the process may be gone and the port taken by another server (another checkout's
    stack, a user's `prefect server start`), which must never get our auth string."""
    from infra.procs import serves_port

    pid, port = _recorded(Path(state_dir))
    if not (serves_port(pid, port) and runs_from(pid, state_dir)):
        return None
    return f"http://127.0.0.1:{port}/api"


def runs_from(pid: int | None, state_dir: Path | str) -> bool:
    """Is `pid` a Prefect server started from this state directory (its database path is in
    its environment)? Guards against a recycled pid; True where /proc cannot tell."""
    db = f"{Path(state_dir).absolute()}/prefect.db".encode()
    try:
        return db in Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def auth_string(state_dir: Path | str, create: bool = True) -> str | None:
    """The server's `user:password` (made on first use, 0600 in the private state dir)."""
    f = Path(state_dir) / AUTH_FILE
    try:
        value = f.read_text().strip()
        if value:
            return value
    except OSError:
        pass
    if not create:
        return None
    private_dir(f.parent)
    value = f"rollart:{secrets.token_urlsafe(32)}"
    write_private(f, value)
    return value


def auth_for(api_url: str, state_dir: Path | str = DEFAULT_STATE_DIR) -> str | None:
    """The auth string of our server in `state_dir` when `api_url` is that server (and the
    server on that port is still ours)."""
    if api_url.rstrip("/") != ours(state_dir):
        return None
    return auth_string(state_dir, create=False)


def basic_auth_header(auth: str | None) -> dict[str, str]:
    if not auth:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


@dataclass
class PrefectServer:
    api_url: str
    ui_url: str
    pid: int | None
    started: bool  # False when an already-running server was reused
    auth: str | None = None  # basic auth `user:password`; never logged (repr=False below)

    def __repr__(self) -> str:
        return f"PrefectServer(api_url={self.api_url!r}, pid={self.pid}, started={self.started})"

    def client_env(self) -> dict[str, str]:
        """What a Prefect client process needs to reach this server."""
        env = {"PREFECT_API_URL": self.api_url}
        if self.auth:
            env["PREFECT_API_AUTH_STRING"] = self.auth
        return env

    def stop(self) -> None:
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(self.pid, signal.SIGKILL)


def start_server(state_dir: Path | str = DEFAULT_STATE_DIR, port: int | None = None,
                 timeout: float = 90.0) -> PrefectServer:
    """Start (or reuse, via the pid file) a Prefect server on 127.0.0.1.

    Reused only when the recorded pid is alive and is the one listening on the recorded port;
    a port someone else holds is never talked to (nor sent our auth). A new server takes
    `port`, else the default port (`default_port()`) when free, else a free one; a `port`
    that is taken fails at once, in one line naming who holds it."""
    from infra.procs import port_holder, serves_port

    # prefect.db holds the key that decrypts block secrets: a private dir, created 0600.
    state = private_dir(Path(state_dir).absolute())
    pid_file, port_file = state / "prefect.pid", state / "prefect.port"
    auth = auth_string(state)  # before the server starts: it never runs without auth
    old_pid, old_port = _recorded(state)
    if old_pid and old_port and serves_port(old_pid, old_port):
        url = f"http://127.0.0.1:{old_port}/api"
        old = PrefectServer(url, f"http://127.0.0.1:{old_port}", old_pid, started=False,
                            auth=auth)
        if healthy(url):
            if requires_auth(url, auth):
                return old
            if _is_prefect(old.pid):  # ours from before API auth: never keep an open API up
                old.stop()
    if port is None:
        port = default_port() if port_free(default_port()) else free_port()
    elif not port_free(port):
        raise RuntimeError(f"cannot start the Prefect server on 127.0.0.1:{port}: the port is "
                           f"held by {port_holder(port) or 'another process'}")
    env = {
        **os.environ,
        "PREFECT_HOME": str(state / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{state}/prefect.db",
        # The UI otherwise calls the default port's API, i.e. another server.
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
        # Only the server's own UI may call it from a browser (the default is `*`).
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://127.0.0.1:{port}",
    }
    if auth:  # always, but for benchmarks/security_overhead.py's baseline (it patches this)
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    log = append_private(state / "prefect-server.log")
    prefect_bin = Path(sys.executable).with_name("prefect")
    proc = subprocess.Popen(
        [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        umask=PRIVATE_UMASK,
    )
    write_private(pid_file, str(proc.pid))
    write_private(port_file, str(port))
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            holder = port_holder(port)  # lost a race for the port: say to whom
            raise RuntimeError("Prefect server exited early" + (
                f" (127.0.0.1:{port} is held by {holder})" if holder else "")
                + f"; see {state / 'prefect-server.log'}")
        if healthy(url) and serves_port(proc.pid, port):  # its answer, not another server's
            return PrefectServer(url, f"http://127.0.0.1:{port}", proc.pid, started=True,
                                 auth=auth)
        time.sleep(0.5)
    PrefectServer(url, "", proc.pid, True).stop()
    raise TimeoutError(f"Prefect server not healthy after {timeout:.0f}s; see the log in {state}")


def _is_prefect(pid: int | None) -> bool:
    """Guard against a recycled pid: only a process whose command line is a Prefect server."""
    try:
        return b"prefect" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _status(api_url: str, headers: dict[str, str], timeout: float) -> int | None:
    req = urllib.request.Request(f"{api_url}/admin/version", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def requires_auth(api_url: str, auth: str | None, timeout: float = 5.0) -> bool:
    """Does the server at `api_url` accept `auth` and refuse a call without it?"""
    return (_status(api_url, basic_auth_header(auth), timeout) == 200
            and _status(api_url, {}, timeout) == 401)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# The only job variables a deployment or a flow run of the stack's work pool may set. Prefect's
# default process template renders `command`, `env` and `working_dir` from job variables, so
# anyone who may create a flow run (`job_variables={"command": ...}`, or `env` with
# LD_PRELOAD / PYTHONSTARTUP, or a `working_dir` holding its own `flows/train.py`) chooses what
# the worker executes. The server validates every flow run's job variables against this schema
# (additionalProperties: false) and answers 422; the job configuration has no placeholder for
# the command or the working directory either, so nothing renders them.
POOL_ENV_KEYS = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")


def locked_job_template() -> dict:
    env_schema = {"type": "object", "additionalProperties": False,
                  "properties": {k: {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{0,32}$"}
                                 for k in POOL_ENV_KEYS},
                  "title": "Environment Variables",
                  "description": f"Only {', '.join(POOL_ENV_KEYS)}."}
    return {
        "job_configuration": {"command": None, "env": "{{ env }}", "labels": "{{ labels }}",
                              "name": "{{ name }}", "stream_output": "{{ stream_output }}",
                              "working_dir": None},
        "variables": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                         "title": "Name"},
                "env": env_schema,
                "labels": {"type": "object", "additionalProperties": {"type": "string"},
                           "title": "Labels"},
                "stream_output": {"type": "boolean", "default": True, "title": "Stream Output"},
            },
        },
    }
