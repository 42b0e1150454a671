"""Discrete-event simulation of the rollout service and the trainer loop, in simulated time.

The decisions come from the real `RolloutScheduler` (rollart/rollout/scheduler.py), driven the
way `RolloutService` and `run_local` drive it: fill at start, after every finished or failed
episode, after every `take_batch` and after `on_version`; the trainer takes batch u, trains,
syncs the engines, and the scheduler learns version u + 1. What the service does with threads
(episodes, one batcher per engine, the trainer) is played here as events on one heap:

    episode    [queue a turn on an engine -> generate call -> env step]* -> finished | failed
    engine     calls back to back: continuous (whatever is queued) or lockstep (a turn of every
               live episode on the engine), at most max_batch turns, overhead + k * per_request
    trainer    wait for take_batch(u) -> update_s -> sync (engines paused) -> on_version(u + 1)

Events at the same instant run before engine dispatches, so turns that arrive together share one
call (the real batcher's short gathering wait). Seeded `random.Random`; no wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollart.rollout.scheduler import Cancel, RolloutScheduler, Start
from rollart.sim.workload import EpisodePlan, SimConfig, sample_plan

Planner = Callable[[Start, random.Random], EpisodePlan]
_DISPATCH = 1  # priority of engine dispatch events: after everything else at the same instant


class SimStalled(RuntimeError):
    """No event left while the trainer still waits: the workload can never fill a batch."""


@dataclass
class _Episode:
    start: Start
    plan: EpisodePlan
    engine: int
    step: int = 0  # env steps done
    cancelled: bool = False


@dataclass
class _Engine:
    queue: list[tuple[str, _Episode]] = field(default_factory=list)  # (request id, episode)
    running: int = 0  # turns in the call in progress
    call_end: float = 0.0
    paused_until: float = 0.0
    pending: bool = False  # a dispatch event is on the heap
    gathering: bool = False  # continuous: waited batch_wait_s already
    busy_s: float = 0.0
    calls: int = 0


@dataclass
class SimResult:
    wall_s: float
    updates: int  # updates done (iterations unless halted)
    halted: bool  # max_consecutive_failures reached (as the service would raise)
    trainer_busy_s: float  # time inside updates (as benchmarks/async_vs_sync.py counts it)
    trainer_idle_frac: float
    engine_busy_s: list[float]  # time inside generate calls, per engine
    engine_calls: list[int]
    engine_idle_frac: float  # mean over engines
    wait_s: list[float]  # per update: trainer ready -> batch taken
    staleness: list[list[int]]  # per update: update - start version of each consumed group
    batches: list[dict[str, list[str]]]  # per update: group id -> kept episode ids
    counters: dict[str, int]  # scheduler counters + service-side cancels + injected failures

    def summary(self) -> dict[str, Any]:
        """Scalar figures (for JSON and one-line reports)."""
        flat = [s for per in self.staleness for s in per]
        return {"wall_s": self.wall_s, "updates": self.updates, "halted": self.halted,
                "trainer_idle_frac": self.trainer_idle_frac,
                "engine_idle_frac": self.engine_idle_frac,
                "trainer_wait_s": sum(self.wait_s), "engine_calls": sum(self.engine_calls),
                "max_staleness_seen": max(flat, default=0),
                "mean_staleness": sum(flat) / len(flat) if flat else 0.0,
                "counters": dict(self.counters)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Simulation:
    def __init__(self, cfg: SimConfig, plan: Planner | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.sched = RolloutScheduler(cfg.scheduler_config())  # the real one, not a copy
        tasks = {t.name: t for t in cfg.tasks}
        self.plan: Planner = plan or (lambda st, rng: sample_plan(tasks[st.task], rng))
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.live: dict[str, _Episode] = {}
        self.engines = [_Engine() for _ in range(cfg.engines)]
        self.group_version: dict[str, int] = {}
        self.counters: Counter[str] = Counter()  # what the service counts beside the scheduler
        # Trainer state: update in progress or awaited, and since when it waits.
        self.update = 0
        self.waiting = True
        self.ready_at = 0.0
        self.done = False
        self.halted = False
        self.trainer_busy_s = 0.0
        self.wait_s: list[float] = []
        self.staleness: list[list[int]] = []
        self.batches: list[dict[str, list[str]]] = []

    # ---- event queue -----------------------------------------------------------------------
    def _at(self, t: float, fn: Callable[..., None], *args: Any, prio: int = 0) -> None:
        heapq.heappush(self._heap, (t, prio, next(self._seq), fn, args))

    def run(self, max_events: int = 50_000_000) -> SimResult:
        self._fill()
        for _ in range(max_events):
            if self.done or self.halted:
                return self._result()
            if not self._heap:
                raise SimStalled(f"no event left at t={self.now:.3f} s while the trainer waits "
                                 f"for update {self.update}; scheduler counters: "
                                 f"{dict(self.sched.counters)}")
            t, _, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        raise SimStalled(f"more than {max_events} events: raise max_events or shrink the run")

    # ---- the service's side: carry out scheduler decisions -----------------------------------
    def _fill(self) -> None:
        self._launch(self.sched.fill())

    def _launch(self, starts: list[Start]) -> None:
        for st in starts:
            # Lockstep keeps an episode on the engine with the fewest live episodes (as
            # RolloutService._launch); continuous routes every turn (see _request).
            on_engine = Counter(ep.engine for ep in self.live.values())
            ep = _Episode(st, self.plan(st, self.rng),
                          min(range(len(self.engines)), key=lambda i: on_engine[i]))
            self.live[st.episode_id] = ep
            self.group_version[st.group_id] = st.version
            self._request(ep)

    def _request(self, ep: _Episode) -> None:
        if self.cfg.batching == "continuous":  # least loaded replica (queued + running)
            ep.engine = min(range(len(self.engines)),
                            key=lambda i: len(self.engines[i].queue) + self.engines[i].running)
        self.engines[ep.engine].queue.append((f"{ep.start.episode_id}#t{ep.step}", ep))
        self._wake(ep.engine)

    def _cancel(self, cancels: list[Cancel]) -> None:
        for c in cancels:
            ep = self.live.pop(c.episode_id, None)
            if ep is None:
                continue
            ep.cancelled = True  # a call in progress still runs; its result is ignored
            eng = self.engines[ep.engine]
            eng.queue = [x for x in eng.queue if x[1] is not ep]
            if c.reason != "redundant":  # the scheduler counts redundant cancels itself
                self.counters[f"cancelled_{c.reason}"] += 1
            self._wake(ep.engine)  # lockstep: one member fewer to wait for

    def _episode_over(self, ep: _Episode, failed: bool) -> None:
        del self.live[ep.start.episode_id]
        if failed:
            starts, cancels = self.sched.on_failed(ep.start.episode_id)
            self._cancel(cancels)
            self._launch(starts)
            self.halted = self.sched.halted
        else:
            self._cancel(self.sched.on_finished(ep.start.episode_id))
        self._wake(ep.engine)
        self._fill()
        self._try_take()

    # ---- engines ---------------------------------------------------------------------------
    def _wake(self, e: int) -> None:
        eng = self.engines[e]
        if not eng.pending:
            eng.pending = True
            self._at(max(self.now, eng.paused_until), self._dispatch, e, prio=_DISPATCH)

    def _dispatch(self, e: int) -> None:
        eng, m = self.engines[e], self.cfg.engine
        eng.pending = False
        if eng.running or not eng.queue:
            return  # _call_done wakes it again
        if self.now < eng.paused_until:  # weight sync in progress
            self._wake(e)
            return
        max_batch = self._max_batch(e)
        if self.cfg.batching == "lockstep":
            members = sum(1 for ep in self.live.values() if ep.engine == e)
            if len(eng.queue) < min(members, max_batch):
                return  # the next member's turn (or its end) wakes it
        elif m.batch_wait_s and not eng.gathering and len(eng.queue) < max_batch:
            eng.gathering, eng.pending = True, True
            self._at(self.now + m.batch_wait_s, self._dispatch, e, prio=_DISPATCH)
            return
        eng.gathering = False
        queued = sorted(eng.queue, key=lambda x: x[0])  # by request id, as EngineBatcher
        items, eng.queue = queued[:max_batch], queued[max_batch:]
        dur = self._call_s(e, items)
        eng.running, eng.call_end = len(items), self.now + dur
        eng.busy_s += dur
        eng.calls += 1
        self._at(eng.call_end, self._call_done, e, items)

    def _max_batch(self, e: int) -> int:
        return self.cfg.engine.max_batch

    def _call_s(self, e: int, items: list[tuple[str, _Episode]]) -> float:
        """Seconds one generate call over `items` takes on engine `e` (subclasses: per class)."""
        return self.cfg.engine.call_s(len(items))

    def _call_done(self, e: int, items: list[tuple[str, _Episode]]) -> None:
        self.engines[e].running = 0
        for _, ep in items:
            if not ep.cancelled:
                self._at(self.now + ep.plan.step_s[ep.step], self._env_done, ep)
        self._wake(e)

    def _env_done(self, ep: _Episode) -> None:
        if ep.cancelled:
            return
        if ep.plan.fail_at == ep.step:
            self.counters["injected_failures"] += 1
            self._episode_over(ep, failed=True)
            return
        ep.step += 1
        if ep.step == len(ep.plan.step_s):
            self._episode_over(ep, failed=False)
        else:
            self._request(ep)

    # ---- trainer ---------------------------------------------------------------------------
    def _try_take(self) -> None:
        if not self.waiting or self.done:
            return
        batch = self.sched.take_batch(self.update)
        self._fill()  # as RolloutService.try_take: taking a batch may make room
        if batch is None:
            return
        self.waiting = False
        self.wait_s.append(self.now - self.ready_at)
        self.staleness.append([self.update - self.group_version[g] for g in batch])
        self.batches.append(batch)
        start, update_s = self._update_start(batch), self._update_s(batch)
        self.trainer_busy_s += update_s
        self._at(start + update_s, self._train_done)

    def _update_start(self, batch: dict[str, list[str]]) -> float:
        """When the update on a just-taken batch can start (subclasses: after its rewards)."""
        return self.now

    def _update_s(self, batch: dict[str, list[str]]) -> float:
        return self.cfg.trainer.update_s

    def _sync_s(self) -> float:
        return self.cfg.trainer.sync_s

    def _train_done(self) -> None:
        # The sync waits for calls in progress, then the engines load weights (no new calls).
        end = max([self.now] + [g.call_end for g in self.engines if g.running])
        end += self._sync_s()
        for eng in self.engines:
            eng.paused_until = end
        self._at(end, self._sync_done)

    def _sync_done(self) -> None:
        self.update += 1
        if self.update == self.cfg.iterations:
            self.done = True
            return
        self._cancel(self.sched.on_version(self.update))  # RolloutService.set_version
        self._fill()
        self.waiting, self.ready_at = True, self.now
        for e in range(len(self.engines)):
            self._wake(e)
        self._try_take()

    def _result(self) -> SimResult:
        wall = self.now
        # A call still running at the end counts only up to the end.
        busy = [g.busy_s - max(0.0, g.call_end - wall) if g.running else g.busy_s
                for g in self.engines]

        def frac(x: float) -> float:
            return x / wall if wall > 0 else 0.0

        return SimResult(
            wall_s=wall, updates=self.update, halted=self.halted,
            trainer_busy_s=self.trainer_busy_s,
            trainer_idle_frac=1.0 - frac(min(self.trainer_busy_s, wall)),
            engine_busy_s=busy, engine_calls=[g.calls for g in self.engines],
            engine_idle_frac=1.0 - sum(frac(b) for b in busy) / len(busy),
            wait_s=self.wait_s, staleness=self.staleness, batches=self.batches,
            counters=dict(self.sched.counters + self.counters))


def simulate(cfg: SimConfig, plan: Planner | None = None) -> SimResult:
    """Play `cfg.iterations` updates; `plan(start, rng)` overrides how episodes go (tests)."""
    return Simulation(cfg, plan).run()
