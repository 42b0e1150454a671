"""Child side of `rollart.rewards.guard`: one warm process that runs reward handlers.

Started by the guard's pool as `python -I -c BOOT SYS_PATH CONFIG` with two pipe fds. Before it
says it is ready it:

- dies with its parent (PR_SET_PDEATHSIG = SIGKILL, then checks the parent is still the one
  that started it), so a killed Dask worker or a crashed run leaves no handler running;
- caps its own memory (RLIMIT_DATA, soft == hard: the handler cannot raise it; a handler that
  allocates past it gets MemoryError, and this process then exits so nothing half-broken is
  reused) and writes no core dumps;
- imports the handler modules the pool already uses (warm: math-verify's sympy import costs
  ~0.5 s once, not per call).

Then it answers requests on the main thread, one at a time, which is where math-verify's own
signal-based timeout works; the pool's hard timeout (SIGKILL of this process group) stands
behind it for whatever does not return. Messages are length-prefixed JSON both ways (events
and results are JSON on Lambda too): nothing from this process is unpickled by the parent.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import resource
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct(">I")
MAX_MESSAGE = 16 << 20  # bytes; Lambda's own payload limit is 6 MB
PR_SET_PDEATHSIG = 1


class Context:
    """The parts of the Lambda context object handlers use (code_exec caps its sandbox runs at
    the remaining time, so they end before the pool's deadline kills this process)."""

    def __init__(self, function_name: str, deadline: float, memory_mb: int) -> None:
        self.function_name = function_name
        self.memory_limit_in_mb = memory_mb
        self.aws_request_id = f"local-{os.getpid()}-{time.monotonic_ns()}"
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def read_message(fd: int) -> dict[str, Any] | None:
    """One request, or None at EOF (the parent closed the pipe or went away)."""
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise ValueError(f"request of {size} bytes")
    body = _read_exact(fd, size)
    return None if body is None else json.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_message(fd: int, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, default=_jsonable, allow_nan=True).encode()
    data = HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _jsonable(value: Any) -> Any:
    """numpy / torch scalars and the like become floats; anything else its text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def resolve(path: str) -> Callable[..., Any]:
    modname, _, attr = path.rpartition(".")
    fn = getattr(importlib.import_module(modname), attr)
    if not callable(fn):
        raise TypeError(f"reward handler {path!r} is not callable")
    return fn


def confine(parent: int, memory_mb: int) -> None:
    """Die with the parent; cap memory; no core files."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(3)  # the parent is gone already (or we cannot follow it): nobody wants us
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def serve(rfd: int, wfd: int, memory_mb: int, preload: list[str]) -> None:
    handlers: dict[str, Callable[..., Any]] = {}
    for path in preload:  # a module that fails to import fails its first call, not the start
        try:
            handlers[path] = resolve(path)
        except Exception:  # noqa: BLE001
            pass
    write_message(wfd, {"ready": sorted(handlers)})
    while (req := read_message(rfd)) is not None:
        path = str(req["handler"])
        try:
            if path not in handlers:
                handlers[path] = resolve(path)
            if req.get("load"):  # imported: the call's clock starts after this
                write_message(wfd, {"loaded": path})
                continue
            ctx = Context(path, time.monotonic() + float(req["timeout_s"]), memory_mb)
            result = handlers[path](req["event"], ctx)
            write_message(wfd, {"ok": result})
        except MemoryError:
            handlers.clear()  # free what we can to say so, then go: never reused after this
            write_message(wfd, {"error": "MemoryError", "message":
                                f"the handler exceeded its memory limit ({memory_mb} MiB)"})
            os._exit(4)
        except Exception as err:  # noqa: BLE001 - the handler's error, reported like Lambda's
            write_message(wfd, {"error": type(err).__name__, "message": str(err)[:2000]})


def main() -> None:
    cfg = json.loads(sys.argv[2])
    confine(int(cfg["parent"]), int(cfg["memory_mb"]))
    serve(int(cfg["in"]), int(cfg["out"]), int(cfg["memory_mb"]), list(cfg["preload"]))
