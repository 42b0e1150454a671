"""Process and HTTP helpers of the local stack (infra/stack.py): ports, health checks, PIDs.

Every process the stack starts leads its own session, so stopping its process group stops its
children too; a PID is only signalled when its command line still matches what we started.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from infra.prefect_server import port_free, start_server  # noqa: F401 (re-exported)


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (OSError, urllib.error.HTTPError):
        return False


def http_json(url: str, body: Any = None, timeout: float = 5.0,
              headers: dict[str, str] | None = None, method: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def alive(pid: int | None, token: str | None = None) -> bool:
    """Is `pid` running, and (when given) is `token` in its command line? Guards against a
    recycled PID: we never signal a process we did not start."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if token is None:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return True  # no /proc: trust the pid file
    return token in cmdline


def _group_alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child (else it stays a zombie)
    except ChildProcessError:
        pass
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_pids(pids: list[int], timeout: float = 15.0) -> None:
    """SIGTERM the process groups these PIDs lead, all at once; SIGKILL what is left after
    `timeout` seconds."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        live = []
        for pid in pids:
            try:
                os.killpg(pid, sig)
                live.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            live = [p for p in live if _group_alive(p)]
            time.sleep(0.1)
        pids = live
        if not pids:
            return


def stop_pid(pid: int, timeout: float = 15.0) -> None:
    stop_pids([pid], timeout)


def start_prefect(state: Path, port: int, timeout: float) -> Any:
    """start_server, with the UI told where its API is: without PREFECT_UI_API_URL the UI of a
    server on any port but 4200 calls http://127.0.0.1:4200/api (another server, or none)."""
    old = os.environ.get("PREFECT_UI_API_URL")
    os.environ["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
    try:
        return start_server(state, port=port, timeout=timeout)
    finally:
        if old is None:
            os.environ.pop("PREFECT_UI_API_URL", None)
        else:
            os.environ["PREFECT_UI_API_URL"] = old
