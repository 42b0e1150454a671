"""Engine replica health for the rollout service: which replicas serve, and waiting for one.

A replica is lost when a call to it shows that its worker is gone or hung: the call ran past
its deadline (`CallTimeoutError`), the connection to its worker failed or closed (`OSError`,
which Dask's `CommClosedError` is), or Dask says the worker holding the actor was lost. Any
other exception from `generate` is the engine's own error (a bad request, a bug): it costs the
episode (`engine_error`), never the replica, and is not counted as an env error.

The rollout service re-issues a turn that was in flight on a lost replica on another one: the
episode's token ids stop at its last completed turn, so the same request goes again and every
token already generated keeps the version that produced it. With no replica left, episodes
wait up to `rollout.engine_wait_timeout_s` for one to come back (the driver's supervisor
creates a replacement when a worker of the class (re)joins, `rollart/runner/recovery.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ReplicaLost(Exception):
    """The replica was marked lost while this turn waited for it: route the turn again."""


class NoReplicaLeft(RuntimeError):
    """Every engine replica stayed lost for longer than `rollout.engine_wait_timeout_s`."""


def is_replica_loss(err: BaseException) -> bool:
    """Does `err`, raised by a call to an engine replica, mean the replica itself is gone?"""
    if isinstance(err, (ReplicaLost, TimeoutError, OSError)):
        return True  # CallTimeoutError is a TimeoutError; CommClosedError is an OSError
    return isinstance(err, RuntimeError) and "Worker holding Actor was lost" in str(err)


class EngineHealth:
    """Thread-safe alive flags of the replicas, with a bounded wait for any alive one."""

    def __init__(self, replicas: int, wait_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alive = [True] * replicas
        self.wait_timeout_s = wait_timeout_s
        self.clock = clock
        self.cv = threading.Condition()
        self.lost_total = 0
        self.back_total = 0
        self.events: list[dict[str, float | int | str]] = []  # lost / back, wall time

    def mark_lost(self, index: int, why: str = "") -> bool:
        """True if this call marked it (the first one to see the loss acts on it)."""
        with self.cv:
            if not self.alive[index]:
                return False
            self.alive[index] = False
            self.lost_total += 1
            self.events.append({"replica": index, "event": "lost", "t": time.time(),
                                "why": why[:200]})
            self.cv.notify_all()
            return True

    def mark_back(self, index: int) -> None:
        with self.cv:
            if self.alive[index]:
                return
            self.alive[index] = True
            self.back_total += 1
            self.events.append({"replica": index, "event": "back", "t": time.time()})
            self.cv.notify_all()

    def alive_indices(self) -> list[int]:
        with self.cv:
            return [i for i, ok in enumerate(self.alive) if ok]

    def lost_indices(self) -> list[int]:
        with self.cv:
            return [i for i, ok in enumerate(self.alive) if not ok]

    def wait_any(self, stop: Callable[[], bool] = lambda: False) -> list[int]:
        """The alive replicas, waiting up to `wait_timeout_s` for one if none is; raises
        NoReplicaLeft past that (or returns [] once `stop()` says the service is stopping)."""
        deadline = self.clock() + self.wait_timeout_s
        with self.cv:
            while True:
                alive = [i for i, ok in enumerate(self.alive) if ok]
                if alive or stop():
                    return alive
                left = deadline - self.clock()
                if left <= 0:
                    raise self.none_left()
                self.cv.wait(min(left, 0.5))

    def none_left(self) -> NoReplicaLeft:
        return NoReplicaLeft(f"every engine replica is lost and none came back within "
                             f"{self.wait_timeout_s:g} s (rollout.engine_wait_timeout_s)")
