"""The asyncio runner's engine batcher (rollart/rollout/aio_runner.py): one task per engine
replica that drains the turns queued for it into `generate` calls, up to the engine's
`concurrent_calls` in flight (1 unless the engine says so)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollart.rollout.batcher import CallOutcome, EpisodeCancelled, LiveEpisode
from rollart.types import Completion, GenerationRequest

if TYPE_CHECKING:
    from rollart.rollout.aio_runner import AsyncRunner


class AsyncBatcher(CallOutcome):
    """EngineBatcher's twin on the loop: continuous (whatever is queued goes, after
    `wait_s`), or lockstep when `members` is given (wait for a turn of each of the `members()`
    live episodes on this engine; requests sorted by id)."""

    def __init__(self, runner: AsyncRunner, engine: Any, max_batch: int, wait_s: float,
                 members: Callable[[], int] | None = None,
                 on_served: Callable[[list[str], float], None] | None = None) -> None:
        self.runner, self.engine, self.max_batch, self.wait_s = runner, engine, max_batch, wait_s
        self.members, self.on_served = members, on_served
        self.queue: list[tuple[GenerationRequest, asyncio.Future, LiveEpisode]] = []
        self.wake = asyncio.Event()
        self.busy_s = 0.0
        self.calls = 0
        self.stopping = False
        # generate calls in flight at once: 1 unless the engine takes concurrent calls (a
        # continuous-batching server: it batches them itself)
        self.concurrent = max(1, int(getattr(engine, "concurrent_calls", 1)))
        self.slots = asyncio.Semaphore(self.concurrent)
        self.direct = members is None and not wait_s and self.concurrent > 1
        self.direct_calls = 0

    async def agenerate(self, request: GenerationRequest, live: LiveEpisode) -> Completion:
        fut = self.runner.loop.create_future()
        item = (request, fut, live)
        if self.direct and not self.queue and not self.stopping and not self.slots.locked():
            # An engine that batches concurrent calls itself, a call slot free, nothing queued
            # and no batch wait: the turn is a call of its own, awaited in the episode's task.
            # Through the batcher it waits for the batcher's wake-up, the call's own task, and
            # the episode's wake-up once the call is back: three loop iterations more, each
            # behind everything else the loop runs then (the overhead p99 at 4,096 episodes).
            await self.slots.acquire()  # a free slot: returns at once
            await self._serve([item], self.slots)
            self.direct_calls += 1  # as `calls`: a call counts once it is back
            return fut.result()
        self.queue.append(item)
        self.wake.set()
        return await fut

    def _ready(self) -> bool:
        if not self.queue:
            return False
        return self.members is None or len(self.queue) >= min(self.members(), self.max_batch)

    def _fail_all(self, err: BaseException) -> None:
        queued, self.queue = self.queue, []
        for _, fut, _ in queued:
            if not fut.done():
                fut.set_exception(err)

    def fail_queued(self, err: BaseException) -> None:
        """The replica is lost: its queued turns go back to their episodes (thread-safe)."""
        self.runner.in_loop(lambda: self._fail_all(err))

    def stop(self) -> None:
        def now() -> None:
            self.stopping = True
            self._fail_all(EpisodeCancelled())
            self.wake.set()
        self.runner.in_loop(now)

    async def run(self) -> None:
        slots = self.slots
        while True:
            await slots.acquire()
            while not self.stopping and not self._ready():
                if self.members is not None:
                    await asyncio.sleep(0.01)
                else:
                    self.wake.clear()
                    await self.wake.wait()
            if self.stopping:
                return
            if self.members is None and self.wait_s and len(self.queue) < self.max_batch:
                await asyncio.sleep(self.wait_s)  # let other episodes' turns join this batch
            queued = sorted(self.queue, key=lambda x: x[0].request_id) if self.members \
                else self.queue
            items, self.queue = queued[: self.max_batch], queued[self.max_batch:]
            for _, fut, live in items:
                if live.cancelled and not fut.done():
                    fut.set_exception(EpisodeCancelled())
            items = [x for x in items if not x[1].done()]
            if not items:
                slots.release()
                continue
            if self.concurrent == 1:  # the next batch waits for this call anyway: no task
                await self._serve(items, slots)
            else:
                self.runner._keep(self.runner.loop.create_task(self._serve(items, slots)))

    async def _serve(self, items: list[tuple[GenerationRequest, asyncio.Future, LiveEpisode]],
                     slots: asyncio.Semaphore) -> None:
        t0 = time.perf_counter()
        try:
            out = await self.runner.call(self.engine, "generate", [r for r, _, _ in items])
        except Exception as err:  # noqa: BLE001 - the episodes decide (CallOutcome)
            self._failed(items, err, t0)
            return
        finally:
            slots.release()
        self._served(items, out, t0)
