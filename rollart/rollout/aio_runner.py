"""Episodes as asyncio tasks: the rollout service's `rollout.runner: asyncio`.

The threaded runner (rollart/rollout/service.py) gives every live episode its own Python thread,
plus one batcher thread per engine replica and a watchdog thread that scans every live episode
each 50 ms. Here one event loop (one thread) runs them all:

    episode task   (one per live episode) open env -> [route -> batcher -> step env]* -> reward
    batcher task   (one per engine replica, aio_batcher.py) drains queued turns into one
                   `generate` call; up to `engine.concurrent_calls` calls in flight
    sweeper        fails an episode whose env call runs past `rollout.env_timeout_s` (it checks
                   the live episodes' deadlines every timeout / 20, 0.05 .. 1 s: a timer per env
                   call cost more than the sweep at thousands of episodes)

The loop is the standard library's (`rollout.event_loop: select`, the default), waiting in
select(2), not epoll: it watches one file (its wake-up pipe), and select takes microsecond
timeouts where epoll rounds every wait up to a whole millisecond; with `rollout.idle_poll_us`
it polls that long before each sleep (PollingSelector). `rollout.event_loop: uvloop`
runs scheduling, timers and wake-ups in C: less CPU per turn on a lightly loaded loop, but its
timers count whole milliseconds, and benchmarks/rollout_scale.py measured a higher turn
overhead p99 on it (docs/concepts/rollout.md).

Handles whose method is a coroutine function (in-process async engines and env hosts, such as the
emulated ones of benchmarks/rollout_scale.py) are awaited on the loop. Anything else (a Dask actor,
the HF engine, a blocking env host) runs in a fixed pool of threads (`rollout.env_host_threads`,
at least 8), through `rollart.handles.call` with its deadline, so thread count never grows with
the number of episodes. The service's bookkeeping (scheduler decisions, ledger, metrics) is the
same code for both runners; only how an episode waits differs.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import selectors
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from rollart.handles import call
from rollart.rollout.batcher import LiveEpisode
from rollart.rollout.episode_step import (
    Action,
    Generate,
    Step,
    reissue_turn,
    route_turn,
    service_steps,
)
from rollart.types import Completion, GenerationRequest

# (turn start, turn end, episode id, turn index): perf_counter seconds, for benchmarks
TurnRecord = tuple[float, float, str, int]
SELECT_FD_LIMIT = 1024  # FD_SETSIZE: select(2) watches descriptors below it only


class PollingSelector(selectors.SelectSelector):
    """select(2) that polls for up to `poll_s` before it sleeps (`rollout.idle_poll_us`): a
    wait shorter than that ends polling, at its timeout; a longer one polls, then sleeps for
    the rest. Each poll releases the GIL, as the sleep does."""

    def __init__(self, poll_s: float) -> None:
        super().__init__()
        self.poll_s = poll_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return super().select(0)
        poll = super().select
        t0 = time.perf_counter()
        limit = self.poll_s if timeout is None else min(self.poll_s, timeout)
        while True:
            ready = poll(0)
            if ready:
                return ready
            spent = time.perf_counter() - t0
            if spent >= limit:
                break
        if timeout is None:
            return poll(None)
        return poll(timeout - spent) if timeout > spent else []


def new_loop(kind: str, poll_s: float = 0.0) -> asyncio.AbstractEventLoop:
    """An event loop of `rollout.event_loop` kind (see the module's docstring); on select,
    polling for up to `poll_s` before each sleep (`rollout.idle_poll_us`)."""
    if kind == "uvloop":
        import uvloop  # the config check names the fix when it is missing

        return uvloop.new_event_loop()
    selector = PollingSelector(poll_s) if poll_s > 0 else selectors.SelectSelector()
    loop = asyncio.SelectorEventLoop(selector)
    if max(key.fd for key in selector.get_map().values()) >= SELECT_FD_LIMIT:
        loop.close()  # select(2) would fail on the loop's first wait
        raise RuntimeError(
            f"rollout.event_loop=select: this process has over {SELECT_FD_LIMIT} files open, "
            "so the loop's wake-up pipe is out of select(2)'s range; set "
            "rollout.event_loop=uvloop (epoll) for this process")
    return loop


class AsyncRunner:
    """Runs the episodes of RolloutService `svc` on one event loop thread."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc
        self.loop = new_loop(svc.cfg.rollout.event_loop, svc.cfg.rollout.idle_poll_us * 1e-6)
        self.pool = ThreadPoolExecutor(max(8, svc.cfg.rollout.env_host_threads),
                                       thread_name_prefix="rollout-io")
        self.tasks: set[asyncio.Task] = set()
        self.turn_log: list[TurnRecord] | None = None  # set to [] to record every turn
        self.thread: threading.Thread | None = None
        self._ident: int | None = None
        self._ready = threading.Event()
        self._coro: dict[tuple[type, str], bool] = {}
        self.gc_collected = 0  # objects the scheduled collections freed (cycles: a leak)

    # ---- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        r = self.svc.cfg.rollout
        if r.gc_every_s is not None:  # see RolloutConfig.gc_every_s
            gc.freeze()
            gc.disable()
        if r.switch_interval_s is not None:  # see RolloutConfig.switch_interval_s
            sys.setswitchinterval(min(sys.getswitchinterval(), r.switch_interval_s))
        self.thread = self.svc._spawn(self._main, name="rollout-loop")
        self._ready.wait()
        for b in self.svc.batchers:
            self.in_loop(lambda b=b: self._keep(self.loop.create_task(b.run())))
        self.in_loop(lambda: self._keep(self.loop.create_task(self._sweep())))

    SWEEP_SLICE = 256  # live episodes checked per loop iteration

    async def _sweep(self) -> None:
        """The watchdog's rule (RolloutService._expired) on the loop, at a coarse period; and
        the process's garbage collection every `rollout.gc_every_s`."""
        svc = self.svc
        period = min(1.0, max(0.05, svc.cfg.rollout.env_timeout_s / 20))
        gc_every = svc.cfg.rollout.gc_every_s
        next_gc = time.monotonic() + (gc_every or 0.0)
        while not svc.stopping:
            await asyncio.sleep(period)
            now = time.monotonic()
            if gc_every is not None and now >= next_gc:
                self.gc_collected += gc.collect()
                next_gc = now + gc_every
            lives = list(svc.live.values())  # a copy: other threads change `live`
            for i in range(0, len(lives), self.SWEEP_SLICE):
                if i:  # thousands of episodes: let the turns in flight go between slices
                    await asyncio.sleep(0)
                    now = time.monotonic()
                for live in lives[i:i + self.SWEEP_SLICE]:
                    if live.deadline is not None and now > live.deadline:
                        svc._expired(live)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._ident = threading.get_ident()
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            tasks = list(self.tasks)
            for t in tasks:
                t.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    def in_loop(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the loop: now if called from it, else soon (thread-safe)."""
        if threading.get_ident() == self._ident:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)

    def _keep(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def launch(self, lives: list[LiveEpisode], slice_size: int = 32) -> None:
        """Start these episodes: one wake-up of the loop for all of them, `slice_size` per
        loop iteration (a new batch's groups start hundreds at once; their first steps in one
        iteration would hold up every turn in flight for tens of milliseconds)."""
        self.in_loop(partial(self._launch_slice, lives, 0, slice_size))

    def _launch_slice(self, lives: list[LiveEpisode], start: int, size: int) -> None:
        # A method, not a closure that schedules itself: that closure is a reference cycle
        # (function -> cell -> function) holding every launched episode until a full garbage
        # collection, and the collections it forces stall the loop (see `start`).
        for live in lives[start:start + size]:
            self._keep(self.loop.create_task(self.episode(live)))
        if start + size < len(lives):
            self.loop.call_soon(self._launch_slice, lives, start + size, size)

    # Freeing a trajectory (thousands of token ids and log-probs) takes ~15 us: a batch of 512,
    # ~8 ms. Slices of RELEASE_SLICE at least RELEASE_GAP_S apart keep it below a few percent of
    # the loop (32 per iteration, back to back, held every turn in flight behind ~0.5 ms slices
    # for the ~16 ms after each take: the overhead p99 of benchmarks/rollout_scale.py).
    RELEASE_SLICE, RELEASE_GAP_S = 8, 0.001

    def release(self, objs: list[Any]) -> None:
        """Drop `objs` (a list no one else holds) on the loop, a slice at a time: their
        deallocation, spread between the turns in flight."""
        self.in_loop(partial(self._release_slice, objs))

    def _release_slice(self, objs: list[Any]) -> None:
        del objs[-self.RELEASE_SLICE:]
        if objs:
            self.loop.call_later(self.RELEASE_GAP_S, self._release_slice, objs)

    def stop(self) -> None:
        if self.thread is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.svc.cfg.rollout.gc_every_s is not None:
            gc.enable()  # the process (a Dask worker) goes on without the loop

    def call(self, handle: Any, method: str, *args: Any) -> Awaitable[Any]:
        """`handle.method(*args)` to await: a coroutine method's own coroutine (on the loop,
        with no frame of ours between it and the caller's), anything else in the pool."""
        key = (type(handle), method)
        coro = self._coro.get(key)
        if coro is None:
            coro = self._coro[key] = inspect.iscoroutinefunction(getattr(handle, method))
        if coro:
            return getattr(handle, method)(*args)
        ctx = contextvars.copy_context()  # a Dask worker's context reaches the pool thread
        return self.loop.run_in_executor(self.pool, ctx.run, call, handle, method, *args)

    # ---- one episode ---------------------------------------------------------------------
    async def episode(self, live: LiveEpisode) -> None:
        """One episode as a task: its turns and what a failure costs are
        rollart/rollout/episode_step.py's; here, only how each action is awaited."""
        svc, st = self.svc, live.start
        steps = service_steps(svc, live, self._turn_done)
        action: Action | None = steps.start()
        while action is not None:
            # The actions are awaited here, not in a helper coroutine: one frame less between
            # the task and every wake-up of a turn (thousands of episodes share the loop).
            try:
                if type(action) is Generate:
                    result = await self._generate(live, action.request, action.new_tokens)
                elif type(action) is Step:
                    result = await self._host(live, "step", live.id, action.text)
                else:  # (system, observation[, prompt ids from a host that tokenizes])
                    result = await self._host(live, "open", live.id, st.task, st.seed)
            except Exception as err:  # what it costs is the steps' policy
                steps.fail(err)
                break
            action = steps.advance(result)
        await self._close(live)
        traj = steps.finish()
        if not svc.episode_over(live, traj, steps.timings, steps.reason, self._locked):
            return
        try:
            fut = svc.reward.submit(traj)
            if not fut.done():
                await asyncio.wrap_future(fut)
            fut.result()
        except Exception as err:  # the reward backend's own policy (retries, on_error) is spent
            svc.set_fatal(err, keep_first=False)
            return
        self._locked(svc._scored, live, traj)

    def _turn_done(self, t0: float, episode_id: str, turn: int) -> None:
        if self.turn_log is not None:  # set while the loop runs (benchmarks/rollout_shard.py)
            self.turn_log.append((t0, time.perf_counter(), episode_id, turn))

    def _locked(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` under the service's lock, without blocking the loop: while the trainer's
        side holds it (taking a batch, starting the next groups: milliseconds at thousands of
        episodes), the loop goes on with other turns and tries again 0.5 ms later."""
        lock = self.svc.lock
        if not lock.acquire(blocking=False):
            self.loop.call_later(0.0005, self._locked, fn, *args)
            return
        try:
            fn(*args)  # its own `with lock` re-enters
        finally:
            lock.release()

    async def _host(self, live: LiveEpisode, method: str, *args: Any) -> Any:
        """An env-host call with the episode's timeout armed; a lost host is routed around."""
        svc = self.svc
        live.deadline = time.monotonic() + svc.cfg.rollout.env_timeout_s
        try:
            return await self.call(svc.hosts[live.host], method, *args)
        except OSError:  # the host's worker is gone: route new episodes around it
            svc.host_lost(live.host)
            raise
        finally:
            live.deadline = None

    async def _close(self, live: LiveEpisode) -> None:
        if self.svc.hosts_alive[live.host]:
            try:
                await self.call(self.svc.hosts[live.host], "close", live.id)
            except Exception:  # best effort: the episode is over either way
                pass

    async def _generate(self, live: LiveEpisode, req: GenerationRequest, new_tokens: int
                        ) -> Completion | None:
        """As thread_runner._generate: a turn lost with its replica goes to another one."""
        svc = self.svc
        flags = svc.health.alive  # read without its lock: a list of bools, set in place
        while True:
            if not flags[live.engine]:  # its replica is gone: the least loaded alive one
                alive = [i for i, ok in enumerate(flags) if ok] or await self._wait_any(live)
                if not alive:
                    return None
                svc.move_engine(live, alive)
            engine = route_turn(svc, live, req, new_tokens)
            if engine is None:  # the router heard of a loss before the health flags
                await asyncio.sleep(0.05)
                continue
            try:
                return await svc.batchers[engine].agenerate(req, live)
            except Exception as err:
                if not reissue_turn(svc, engine, req, err):
                    raise

    async def _wait_any(self, live: LiveEpisode) -> list[int]:
        """No replica serves: wait for one (EngineHealth.wait_any without blocking the loop)."""
        health = self.svc.health
        deadline = health.clock() + health.wait_timeout_s
        while True:
            alive = health.alive_indices()
            if alive or self.svc.stopping or live.cancelled:
                return alive
            if health.clock() > deadline:
                raise health.none_left()
            await asyncio.sleep(0.05)
