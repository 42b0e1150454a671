"""Standalone local Prefect server (SQLite), started once and reused by later runs.

A standalone `prefect server start` keeps history (the ephemeral server loses the last task events
on exit) and gives the Dask worker processes an API URL to report task runs to. State (pid file,
log, database) lives under one directory, loopback only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.state import PRIVATE_UMASK, append_private, private_dir, write_private

DEFAULT_STATE_DIR = Path(os.environ.get("ROLLART_STATE_DIR", ".rollart"))
DEFAULT_PORT = 4200


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


@dataclass
class PrefectServer:
    api_url: str
    ui_url: str
    pid: int | None
    started: bool  # False when an already-running server was reused

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
    """Start (or reuse, via the pid file) a Prefect server on 127.0.0.1."""
    # prefect.db holds the key that decrypts block secrets: a private dir, created 0600.
    state = private_dir(Path(state_dir).absolute())
    pid_file, port_file = state / "prefect.pid", state / "prefect.port"
    if pid_file.exists() and port_file.exists():
        old_port = int(port_file.read_text())
        url = f"http://127.0.0.1:{old_port}/api"
        if healthy(url):
            return PrefectServer(url, f"http://127.0.0.1:{old_port}", int(pid_file.read_text()),
                                 started=False)
    port = port or (DEFAULT_PORT if port_free(DEFAULT_PORT) else free_port())
    env = {
        **os.environ,
        "PREFECT_HOME": str(state / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{state}/prefect.db",
        # The UI otherwise calls the default port's API, i.e. another server.
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }
    env.pop("PREFECT_API_URL", None)
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
            raise RuntimeError(f"Prefect server exited early; see {state / 'prefect-server.log'}")
        if healthy(url):
            return PrefectServer(url, f"http://127.0.0.1:{port}", proc.pid, started=True)
        time.sleep(0.5)
    PrefectServer(url, "", proc.pid, True).stop()
    raise TimeoutError(f"Prefect server not healthy after {timeout:.0f}s; see the log in {state}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
