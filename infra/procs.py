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


def _listening_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets (IPv4 and IPv6, any local address) listening on `port`, from
    /proc/net/tcp{,6}; empty where there is no /proc."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "0A" and \
                            int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(int(fields[9]))
        except (OSError, ValueError):
            continue
    return inodes


def _holds(pid: int, inodes: set[int]) -> bool:
    """Does `pid` have one of these sockets open? (False where its fds are not ours to read.)"""
    want = {f"socket:[{i}]" for i in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                return True
        except OSError:
            continue
    return False


def _session_members(sid: int) -> list[int]:
    """Processes of session `sid` (each stack service leads its own session)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def serves_port(pid: int | None, port: int | None) -> bool:
    """Is `port` listened on by `pid` (or a process of the session it leads)? What makes a
    recorded service ours: a live pid alone is not enough (the port may be someone else's,
    e.g. another checkout's stack or a user's own `prefect server start`)."""
    if not pid or not port:
        return False
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    if not Path("/proc/self/fd").is_dir():  # no /proc: a live pid and a listener will do
        return alive(pid)
    return any(_holds(p, inodes) for p in [pid, *(m for m in _session_members(pid) if m != pid)])


def port_holder(port: int) -> str | None:
    """Who listens on `port`, in words ("pid 123 (prefect server start ...)"), None if no one."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for entry in sorted(os.listdir("/proc"), key=lambda e: (not e.isdigit(), len(e), e)):
        if entry.isdigit() and _holds(int(entry), inodes):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                what = cmd.decode(errors="replace").strip()[:120]
            except OSError:
                what = "?"
            return f"pid {entry} ({what})"
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                uids |= {line.split()[7] for line in f if line.split()[9:10] and
                         line.split()[9].isdigit() and int(line.split()[9]) in inodes}
        except OSError:
            continue
    return f"a process of uid {', '.join(sorted(uids))}" if uids else "another process"


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
