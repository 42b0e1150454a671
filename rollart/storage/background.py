"""Uploads off the critical path: an ordered background writer per process.

A stage hands the writer a snapshot (bytes or trajectories it no longer mutates) and returns at
once; one thread per writer uploads in submission order, so a checkpoint's files, its manifest
and the retention that follows it never overtake each other. Back-pressure: at most
`max_pending` jobs wait; a further submit blocks until the oldest finishes (the caller measures
that wait). A failed job is never silent: its error is raised by the next `submit` or by
`drain()`, which the run calls before it returns.

`shard_writer()` is the process-wide writer for trajectory shards (a module-level helper
persists on a Dask worker across tasks); `flush_all()` drains it, for `client.run` at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("rollart.storage")


class BackgroundError(RuntimeError):
    """A background upload failed; names the job."""


class BackgroundWriter:
    def __init__(self, name: str, max_pending: int = 2) -> None:
        self.name = name
        self.max_pending = max(1, max_pending)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollart-{name}")
        self._jobs: deque[tuple[str, Future]] = deque()
        self._lock = threading.Lock()
        self._done: list[dict[str, Any]] = []

    def submit(self, label: str, fn: Callable[[], Any]) -> float:
        """Queue `fn`; returns the seconds spent waiting for room (back-pressure)."""
        t0 = time.perf_counter()
        self._reap(block_until=self.max_pending - 1)
        wait = time.perf_counter() - t0

        def job() -> Any:
            t = time.perf_counter()
            out = fn()
            return {"label": label, "s": time.perf_counter() - t, "result": out}

        with self._lock:
            self._jobs.append((label, self._pool.submit(job)))
        return wait

    def _reap(self, block_until: int) -> None:
        """Collect finished jobs (raising the first failure); block while more than
        `block_until` jobs are pending."""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                label, fut = self._jobs[0]
                if not fut.done() and len(self._jobs) <= block_until:
                    return
                self._jobs.popleft()
            try:
                self._done.append(fut.result())
            except Exception as err:
                raise BackgroundError(
                    f"background {self.name} job {label!r} failed: {type(err).__name__}: {err}"
                ) from err

    def pending(self) -> int:
        with self._lock:
            return sum(1 for _, f in self._jobs if not f.done())

    def drain(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for every queued job; returns the records of jobs finished since the last drain
        (`label`, `s`, `result`). Raises the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            futs = [f for _, f in self._jobs]
        for f in futs:
            f.exception(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._reap(block_until=0)
        done, self._done = self._done, []
        return done

    def finished(self) -> list[dict[str, Any]]:
        """Records of jobs finished so far (non-blocking; raises a failure if one happened)."""
        self._reap(block_until=10**9)
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_shards: BackgroundWriter | None = None
_shards_lock = threading.Lock()


def shard_writer() -> BackgroundWriter:
    global _shards
    with _shards_lock:
        if _shards is None:
            _shards = BackgroundWriter("shards", max_pending=4)
        return _shards


def flush_all(timeout: float | None = 600.0) -> int:
    """Drain this process's shard writer; returns how many shard uploads completed."""
    with _shards_lock:
        writer = _shards
    return len(writer.drain(timeout)) if writer is not None else 0
