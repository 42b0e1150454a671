"""Reward handlers bounded in time and memory wherever they are called from.

A handler called in-process shares its caller's fate: math-verify's timeout is `signal.alarm`,
which works only on the main thread, so `9^{9^{9^{9}}}` scored from a Dask worker thread ran
for minutes; a handler that allocates without bound takes the worker with it; `os._exit` ends
it. So the local reward client never calls a handler itself: a `HandlerPool` of warm child
processes (`rollart.rewards.guard_worker`) runs them, one call at a time per child, and

- a call past its timeout SIGKILLs the child's process group (works from any thread) and
  raises `HandlerTimeout`; the pool starts a replacement in the background;
- each child caps its memory (RLIMIT_DATA): an allocation past it is `MemoryError` in the
  handler, reported as `HandlerCrashed`, and that child is replaced;
- a child that dies (a crash, `os._exit`, the OOM killer) is `HandlerCrashed`;
- a handler's own exception is `HandlerError`.

All four are `HandlerFailure`s, which the client turns into the run's `reward.on_error`
(retry, zero, fail), as the Lambda client does with a FunctionError. The children start from
a dedicated long-lived thread, because PR_SET_PDEATHSIG follows the *thread* that forked: a
Dask task thread or an episode thread that ends would otherwise kill them. Per call the cost is
two pipe messages of JSON (measured: docs/guides/security.md, "Reward handlers, bounded").

On Lambda (the local endpoint or AWS) the function's own timeout and memory size bound the
handler instead: the endpoint kills a worker past the timeout and caps its memory.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

from rollart.rewards.guard_worker import HEADER, MAX_MESSAGE, write_message

BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from rollart.rewards.guard_worker import main; main()")
START_TIMEOUT_S = 120.0  # a child's start-up and a handler module's first import
IDLE_S = 300.0  # children idle this long are stopped (one is kept warm)


class HandlerFailure(RuntimeError):
    """The handler gave no result: it raised, ran out of time or memory, or its process died."""


class HandlerError(HandlerFailure):
    """The handler raised (the message is `Type: message`, as Lambda reports it)."""


class HandlerTimeout(HandlerFailure):
    """The handler ran past its timeout; its process was killed."""


class HandlerCrashed(HandlerFailure):
    """The handler's process died or ran out of memory."""


class _Spawner:
    """Runs every Popen on one long-lived thread (see the module docstring: PDEATHSIG)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = SimpleQueue()
        threading.Thread(target=self._run, name="reward-guard-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                fut.set_exception(err)

    def run(self, fn: Callable[[], Any]) -> Any:
        fut: Future[Any] = Future()
        self._jobs.put((fn, fut))
        return fut.result()


class _Child:
    """One warm handler process and its two pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], wfd: int, rfd: int) -> None:
        self.proc, self.wfd, self.rfd = proc, wfd, rfd
        self.poller = select.poll()
        self.poller.register(rfd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self.loaded: set[str] | None = None  # None until it said it is ready
        self.idle_since = time.monotonic()

    def send(self, msg: dict[str, Any]) -> None:
        try:
            write_message(self.wfd, msg)
        except OSError as err:  # it died while idle
            raise HandlerCrashed(f"reward handler process is gone ({err})") from None

    def recv(self, deadline: float) -> dict[str, Any]:
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
        if size > MAX_MESSAGE:
            raise HandlerCrashed(f"reward handler process sent {size} bytes")
        return json.loads(self._read(size, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.poller.poll(left * 1000):
                raise TimeoutError
            chunk = os.read(self.rfd, n - len(buf))
            if not chunk:
                raise HandlerCrashed(f"reward handler process died ({self._exit_text()})")
            buf += chunk
        return bytes(buf)

    def _exit_text(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "no exit status"
        if code < 0:
            name = signal.Signals(-code).name
            return f"killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
        return f"exit status {code}"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: what it started too
        except (ProcessLookupError, PermissionError):
            pass
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class HandlerPool:
    """Warm handler processes for this process: at most `max_workers`, grown on demand."""

    def __init__(self, memory_mb: int = 2048, max_workers: int = 32) -> None:
        self.memory_mb, self.max_workers = memory_mb, max_workers
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._live = 0
        self._seen: list[str] = []  # handler paths used so far: new children preload them
        self._closed = False

    # ---- children ----------------------------------------------------------------------
    def _start(self) -> _Child:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        cfg = {"in": req_r, "out": resp_w, "memory_mb": self.memory_mb, "parent": os.getpid(),
               "preload": list(self._seen)}

        def popen() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-I", "-c", BOOT, json.dumps(sys.path), json.dumps(cfg)],
                stdin=subprocess.DEVNULL, pass_fds=(req_r, resp_w), close_fds=True,
                start_new_session=True)

        try:
            proc = _spawner().run(popen)
        finally:
            os.close(req_r)
            os.close(resp_w)
        return _Child(proc, req_w, resp_r)

    def _acquire(self) -> _Child:
        with self._cond:
            while True:
                if self._closed:
                    raise HandlerFailure("the reward handler pool is closed")
                now = time.monotonic()
                while len(self._idle) > 1 and now - self._idle[0].idle_since > IDLE_S:
                    self._drop(self._idle.pop(0))  # oldest first; one stays warm
                while self._idle:
                    child = self._idle.pop()  # the most recently used: warmest caches
                    if child.proc.poll() is None:
                        return child
                    self._drop(child)  # died while idle (the OOM killer, say): not a failure
                if self._live < self.max_workers:
                    self._live += 1
                    break
                self._cond.wait()
        try:
            return self._start()
        except BaseException:
            self._lost()
            raise

    def _release(self, child: _Child) -> None:
        child.idle_since = time.monotonic()
        with self._cond:
            if self._closed:
                self._drop(child)
                return
            self._idle.append(child)
            self._cond.notify()

    def _drop(self, child: _Child) -> None:
        """Under the lock: stop one child."""
        child.kill()
        self._live -= 1
        self._cond.notify()

    def _lost(self) -> None:
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def _replace(self) -> None:
        """A child was killed: start its successor now, off the caller's path, so the next
        call finds it warm."""
        def start() -> None:
            with self._cond:
                if self._closed or self._live >= self.max_workers or self._idle:
                    return
                self._live += 1
            try:
                child = self._start()
            except BaseException:  # noqa: BLE001 - the next call will start one itself
                self._lost()
                return
            self._release(child)

        threading.Thread(target=start, name="reward-guard-replace", daemon=True).start()

    # ---- calls -------------------------------------------------------------------------
    def call(self, handler: str, event: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """`handler(event, context)` in a child, at most `timeout_s` seconds of its time."""
        if handler not in self._seen:
            self._seen.append(handler)
        child = self._acquire()
        reusable = False  # only a child that answered (a result or the handler's own error)
        try:
            if child.loaded is None:
                child.loaded = set(child.recv(time.monotonic() + START_TIMEOUT_S)["ready"])
            if handler not in child.loaded:  # import time is not the handler's time
                child.send({"handler": handler, "load": True})
                msg = child.recv(time.monotonic() + START_TIMEOUT_S)
                reusable = msg.get("error") != "MemoryError"
                self._answer(msg, handler)
                child.loaded.add(handler)
            child.send({"handler": handler, "event": event, "timeout_s": timeout_s})
            reusable = False
            try:
                msg = child.recv(time.monotonic() + timeout_s)
            except TimeoutError:
                raise HandlerTimeout(f"reward handler {handler} timed out after "
                                     f"{timeout_s:g}s (killed)") from None
            reusable = msg.get("error") != "MemoryError"  # after MemoryError it exits
            return self._answer(msg, handler)
        except TimeoutError:
            raise HandlerCrashed(f"reward handler process for {handler} did not start within "
                                 f"{START_TIMEOUT_S:g}s") from None
        finally:
            if reusable:
                self._release(child)
            else:  # timed out, died, or in an unknown state: never reused
                with self._cond:
                    self._drop(child)
                self._replace()

    @staticmethod
    def _answer(msg: dict[str, Any], handler: str) -> dict[str, Any]:
        if "error" in msg:
            text = f"{msg['error']}: {msg.get('message', '')}".strip()
            if msg["error"] == "MemoryError":
                raise HandlerCrashed(text)
            raise HandlerError(text)
        if "loaded" in msg:
            return {}
        result = msg.get("ok")
        if not isinstance(result, dict):
            raise HandlerError(f"reward handler {handler} returned {type(result).__name__}, "
                               "not a dict")
        return result

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._idle:
                self._drop(self._idle.pop())


_POOLS: dict[tuple[int, int], HandlerPool] = {}
_LOCK = threading.Lock()
_SPAWNER: _Spawner | None = None


def _spawner() -> _Spawner:
    global _SPAWNER
    with _LOCK:
        if _SPAWNER is None or _SPAWNER.pid != os.getpid():  # none yet, or we are a fork
            _SPAWNER = _Spawner()
        return _SPAWNER


def get_pool(memory_mb: int, max_workers: int) -> HandlerPool:
    """This process's pool for these limits (a forked child gets its own, never its
    parent's pipes)."""
    key = (memory_mb, max_workers)
    with _LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.pid != os.getpid():
            pool = _POOLS[key] = HandlerPool(memory_mb, max_workers)
        return pool


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS.values()):
        if pool.pid == os.getpid():
            pool.close()
