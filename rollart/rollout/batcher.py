"""Turn batching for the rollout service: one `EngineBatcher` per engine replica.

Episode threads queue their next turn; the batcher's thread sends the queued turns of many
episodes as one `generate` call. `lockstep` waits for a turn of every live episode on the engine
(deterministic batches: requests sorted by id); otherwise whatever is ready goes after a short
gathering wait (turn-level continuous batching).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rollart.handles import call
from rollart.rollout.scheduler import Start
from rollart.types import Completion, GenerationRequest

__all__ = ["CallOutcome", "EngineBatcher", "EpisodeCancelled", "LiveEpisode", "call"]


class EpisodeCancelled(Exception):
    """The episode was cancelled (redundant, stale, timed out) while its request was queued."""


class CallOutcome:
    """What both runners' batchers do with a `generate` call's outcome. `items` are the
    call's (request, future, episode) triples; `t0` the perf_counter time the call began."""

    busy_s: float
    calls: int
    on_served: Callable[[list[str], float], None] | None

    def _failed(self, items: list[tuple[Any, Any, Any]], err: BaseException, t0: float) -> None:
        """The episodes decide: re-issue (replica lost) or fail. No `on_served`: a failed
        call's time says nothing of the replica."""
        self.busy_s += time.perf_counter() - t0
        self.calls += 1
        for _, fut, _ in items:
            if not fut.done():
                fut.set_exception(err)

    def _served(self, items: list[tuple[Any, Any, Any]], out: list[Completion], t0: float
                ) -> None:
        busy = time.perf_counter() - t0
        self.busy_s += busy
        self.calls += 1
        if self.on_served is not None:
            self.on_served([r.request_id for r, _, _ in items], busy)
        for (_, fut, _), comp in zip(items, out, strict=True):
            if not fut.done():  # a turn failed or cancelled meanwhile
                fut.set_result(comp)


@dataclass
class LiveEpisode:
    start: Start
    engine: int
    host: int
    cancelled: bool = False
    deadline: float | None = None  # monotonic time an env call in progress must end by

    @property
    def id(self) -> str:
        return self.start.episode_id


class EngineBatcher(CallOutcome):
    """Batches the turns of many episodes for one engine replica: continuous (whatever is
    ready goes), or lockstep when `members` is given (wait for a turn of each of the `members()`
    live episodes on this engine; requests sorted by id, so batches are deterministic)."""

    def __init__(self, engine: Any, max_batch: int, wait_s: float,
                 members: Callable[[], int] | None = None,
                 on_served: Callable[[list[str], float], None] | None = None) -> None:
        self.engine, self.max_batch, self.wait_s = engine, max_batch, wait_s
        self.members = members
        self.on_served = on_served  # (request ids, busy seconds) after each engine call
        self.queue: deque[tuple[GenerationRequest, Future, LiveEpisode]] = deque()
        self.cv = threading.Condition()
        self.busy_s = 0.0
        self.calls = 0
        self.stopping = False
        self.thread: threading.Thread | None = None
        self._in_hand: list[tuple[GenerationRequest, Future, LiveEpisode]] = []  # in a call

    def generate(self, request: GenerationRequest, live: LiveEpisode) -> Completion:
        fut: Future[Completion] = Future()
        with self.cv:
            if self.stopping:
                raise EpisodeCancelled()  # nothing would ever serve it
            self.queue.append((request, fut, live))
            self.cv.notify()
        return fut.result()

    def _ready(self) -> bool:
        if not self.queue:
            return False
        return self.members is None or len(self.queue) >= min(self.members(), self.max_batch)

    def stop(self) -> None:
        """Fail queued turns, let the call in progress finish, end the thread. A thread that
        died in a call (an uncaught error, SystemExit) left that call's turns unanswered: they
        are failed too, so no episode thread waits on it for ever (a rebuilt service,
        rollart/runner/recovery.py, stops the broken one first)."""
        with self.cv:
            self.stopping = True
            while self.queue:
                self.queue.popleft()[1].set_exception(EpisodeCancelled())
            self.cv.notify_all()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=30.0)
        if self.thread is None or not self.thread.is_alive():
            for _, fut, _ in self._in_hand:
                if not fut.done():
                    fut.set_exception(EpisodeCancelled())

    def fail_queued(self, err: BaseException) -> None:
        """The replica is lost: its queued turns go back to their episodes (re-routed there)."""
        with self.cv:
            while self.queue:
                self.queue.popleft()[1].set_exception(err)
            self.cv.notify_all()

    def loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and not self._ready():
                    self.cv.wait(0.01 if self.members else None)
                if self.stopping:
                    return
            if not self.members and self.wait_s and len(self.queue) < self.max_batch:
                time.sleep(self.wait_s)  # let the other episodes' turns join this batch
            with self.cv:
                if self.stopping:
                    return
                queued = sorted(self.queue, key=lambda x: x[0].request_id)
                items = self._in_hand = queued[: self.max_batch]
                self.queue = deque(queued[self.max_batch:])
            for _, fut, live in items:
                if live.cancelled:
                    fut.set_exception(EpisodeCancelled())
            items = [x for x in items if not x[2].cancelled]
            if not items:
                continue
            t0 = time.perf_counter()
            try:
                out = call(self.engine).generate([r for r, _, _ in items])
            except Exception as err:  # noqa: BLE001 - the episodes decide (CallOutcome)
                self._failed(items, err, t0)
                self._in_hand = []
                continue
            self._served(items, out, t0)
            self._in_hand = []
