"""The rollout service: episodes keep flowing across iteration boundaries, bounded staleness.

One long-lived object per run (a Dask actor on a CPU-class worker, or a plain object in local
runs). The pure `RolloutScheduler` decides which groups start, which finishers are kept and
which episodes are cancelled or re-issued; this module only carries those decisions out:

    episode thread  (one per live episode: the env manager of that episode)
        open env on an env host -> [generate on its engine -> step env]* -> score reward
    batcher thread  (one per engine replica)
        drains queued turn requests of all episodes into one `generate` call (turn-level
        continuous batching), so episodes are independent and never wait for a batch barrier
    watchdog thread
        fails an env call that runs past `rollout.env_timeout_s` (a hung env costs one episode)

Rewards are scored the moment an episode ends; a group is complete when `group_size` members
are scored. The trainer takes complete groups with `take_batch(update)`, and after each update
the engines switch weights between two `generate` calls (requests in flight finish on the old
version, which every token records) and `set_version` lets the scheduler drop what went stale.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rollart.config import RunConfig
from rollart.metrics import TrajStats, traj_stats
from rollart.models.chat import ChatFormat
from rollart.rollout.aio_batcher import AsyncBatcher
from rollart.rollout.aio_runner import AsyncRunner
from rollart.rollout.batcher import EngineBatcher, LiveEpisode, call
from rollart.rollout.failover import EngineHealth
from rollart.rollout.pacing import StartPacer
from rollart.rollout.plan import plan_namer, plan_resampler
from rollart.rollout.scheduler import Cancel, RolloutScheduler, SchedulerConfig, Start
from rollart.rollout.service_failures import ReplicaFailures, RolloutBroken
from rollart.rollout.service_metrics import service_metrics
from rollart.rollout.shards import shard_namer, shard_quota
from rollart.rollout.thread_runner import run_episode
from rollart.rollout.turn_router import TurnRouter
from rollart.types import SamplingParams, Trajectory

Drop = tuple[str, int, str]  # (sample id, iteration, reason) for the sample ledger


def _param_count(engine: Any) -> float:
    """Parameters of the served model: a bare engine's model, or EngineService.param_count."""
    if hasattr(engine, "model"):
        return float(sum(p.numel() for p in engine.model.parameters()))
    return float(call(engine).param_count())


@dataclass
class _Totals:
    counters: Counter[str] = field(default_factory=Counter)
    drops: list[Drop] = field(default_factory=list)  # handed to the trainer with the next batch


class RolloutService(ReplicaFailures):
    def __init__(self, cfg: RunConfig, chat: ChatFormat, engines: list[Any], hosts: list[Any],
                 reward_client: Any, params: dict[str, SamplingParams], version: int = 0,
                 max_context: int = 1024, shard: tuple[int, int] = (0, 1)) -> None:
        """`shard` (k, n): this service runs shard k of n (rollart/rollout/shards.py): its
        scheduler owns the groups of its slots of every batch, under the same rules."""
        r = cfg.rollout
        self.shard = shard
        quota = shard_quota(cfg, *shard) if shard[1] > 1 else None
        namer = plan_namer(cfg)
        self.cfg, self.chat, self.reward, self.params = cfg, chat, reward_client, params
        self.hosts, self.hosts_alive = hosts, [True] * len(hosts)
        self.host_events: list[dict[str, Any]] = []
        self.max_context = max_context
        self.tasks = {t.name: t for t in cfg.tasks}
        self.sched = RolloutScheduler(
            SchedulerConfig.from_rollout(
                r, task_shares=tuple((t.name, t.share) for t in cfg.tasks),
                max_updates=cfg.iterations, quota=quota),
            version=version, first_iteration=version,
            group_of=shard_namer(cfg, namer, *shard) if shard[1] > 1 else namer,
            resample_of=plan_resampler(cfg))
        lockstep = r.batching == "lockstep"
        # asyncio: episodes are tasks on one event loop thread (rollart/rollout/aio_runner.py)
        self.runner = AsyncRunner(self) if r.runner == "asyncio" else None
        self.batchers: list[Any] = [
            (EngineBatcher if self.runner is None else partial(AsyncBatcher, self.runner))(
                e, cfg.engine.max_batch_size, r.batch_wait_s,
                (lambda i=i: self._members(i)) if lockstep else None,
                lambda ids, busy, i=i: self.routing.served(i, ids, busy))
            for i, e in enumerate(engines)]
        # Continuous batching routes every turn (hardware affinity, stickiness, spill); lockstep
        # keeps each episode on the replica it started on (its batch waits for its members).
        self.routing = TurnRouter(cfg, lambda: _param_count(engines[0]),
                                  dynamic=not lockstep and len(engines) > 1)
        self.health = EngineHealth(len(engines), r.engine_wait_timeout_s)
        self.live: dict[str, LiveEpisode] = {}
        # live episodes per engine replica / env host, kept in step with `live` (placement
        # reads them for every start: counting them over `live` cost O(live) per launch)
        self.on_engine: Counter[int] = Counter()
        self.on_host: Counter[int] = Counter()
        self._filling = False  # asyncio: a sliced fill is under way on the loop (`_fill`)
        self._pacer = StartPacer(r.start_rate, self.START_BURST_S,  # `_fill_slice`
                                 r.group_size + r.redundancy)
        self.done: dict[str, Trajectory] = {}
        self.done_stats: dict[str, TrajStats] = {}  # of `done`: the batch metrics' inputs
        self.totals = _Totals()
        self._failed_reported = 0  # `failed` counter as of the last batch's metrics
        self.lock = threading.Condition()
        self.fatal: BaseException | None = None
        self.recent_errors: deque[str] = deque(maxlen=20)  # for the run's logs and stats
        self._probing: set[int] = set()
        self._seq = itertools.count()
        self._launched: dict[str, int] = {}  # episode id -> launch sequence number
        self._taken: tuple[int, Any] | None = None  # the last batch handed out, by update
        self.stopping = False
        self.started = False  # `broken` watches its threads from then on
        self.deferred: list[Start] = []  # restored members (snapshot.restore) to launch at start
        self.started_at = time.perf_counter()
        # Threads run in a copy of the creator's context: on a Dask worker that carries the
        # worker, which actor handles need to reach their workers from our threads.
        self._context = contextvars.copy_context()
        self._watchdog = self._spawn(self._watch, name="rollout-watch", start=False)

    def _spawn(self, target: Callable[..., None], *args: Any, name: str,
               start: bool = True) -> threading.Thread:
        t = threading.Thread(target=self._context.copy().run, args=(target, *args),
                             daemon=True, name=name)
        if start:
            t.start()
        return t

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.runner is not None:
            self.runner.start()  # its timers do the watchdog's work
        else:
            for b in self.batchers:
                b.thread = self._spawn(b.loop, name="rollout-batcher")
            self._watchdog.start()
        self.started = True
        with self.lock:
            self._launch(self.deferred)
            self.deferred = []
            self._fill()

    def snapshot(self) -> tuple[bytes | None, list[Trajectory]]:
        """Unconsumed groups for the checkpoint (rollart/rollout/snapshot.py); (None, []) when
        there are none (a synchronous run), so its checkpoints stay as they were."""
        from rollart.rollout import snapshot

        state, trajs = snapshot.snapshot(self)
        return (state, trajs) if json.loads(state)["groups"] or self.totals.drops else (None, [])

    def restore_state(self, state: bytes, trajs: list[Trajectory]) -> dict[str, int]:
        from rollart.rollout import snapshot

        return snapshot.restore(self, state, trajs)

    def stop(self) -> dict[str, Any]:
        with self.lock:
            self.stopping = True
            for live in self.live.values():
                live.cancelled = True
            self.live.clear()
            self.on_engine.clear()
            self.on_host.clear()
        for b in self.batchers:
            b.stop()
        if self.runner is not None:
            self.runner.stop()
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=1.0)
        return self.stats()

    # ---- the trainer's side ----------------------------------------------------------------
    def try_take(self, update: int) -> tuple[list[Trajectory], dict[str, Any]] | None:
        """The trajectories of `num_groups` complete groups for update `update`, or None.
        Asked again for the update it last answered, it answers the same: Dask re-runs a
        collect stage whose worker died after the batch was taken (an env-host worker, say),
        and the scheduler has moved on to the next update, so a fresh take would wait for
        ever. The trainer refuses to apply an update twice (`UpdateOutOfOrder`)."""
        with self.lock:
            if self.fatal is not None:
                raise RuntimeError(f"rollout service failed: {self.fatal}") from self.fatal
            if self._taken is not None and self._taken[0] == update:
                return self._taken[1]
            batch = self.sched.take_batch(update)
            self._record_discarded()
            self._fill()
            if batch is None:
                return None
            # Launch order, not finishing order: the update (and the ledger) must not depend on
            # which episode happened to finish first.
            kept = sorted((e for members in batch.values() for e in members),
                          key=self._launched.pop)
            trajs = [self.done.pop(e) for e in kept]
            stats = [self.done_stats.pop(e, None) or traj_stats(t)  # restored: not computed
                     for e, t in zip(kept, trajs, strict=True)]
            drops, self.totals.drops = self.totals.drops, []
            metrics: dict[str, float] = {}
            out = trajs, {"dropped": drops, "metrics": metrics}
            previous, self._taken = self._taken, (update, out)
        if previous is not None and self.runner is not None:
            # Freeing a batch of thousands of trajectories takes milliseconds of the caller's
            # thread (under the GIL, the loop's time); the loop lets go of them a slice at a time.
            self.runner.release(list(previous[1][0]))
            del previous
        # Outside the lock: a batch's statistics take milliseconds at thousands of episodes,
        # and the episodes that finish meanwhile need the lock.
        metrics.update(service_metrics(self, trajs, stats))
        return out

    def take_batch(self, update: int, timeout: float | None = None
                   ) -> tuple[list[Trajectory], dict[str, Any]]:
        t0 = time.perf_counter()
        while True:
            out = self.try_take(update)
            if out is not None:
                out[1]["metrics"]["rollout/wait_s"] = time.perf_counter() - t0
                return out
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"no complete batch for update {update} in {timeout} s")
            if (why := self.broken()) is not None:
                raise RolloutBroken(f"rollout service broken: {why}")
            with self.lock:
                self.lock.wait(0.05)

    def set_version(self, version: int) -> None:
        """The engines now serve `version`: drop what went stale, start what may now start."""
        with self.lock:
            self._cancel(self.sched.on_version(version))
            self._record_discarded()
            self._fill()

    # ---- episodes ----------------------------------------------------------------------------
    def _members(self, engine: int) -> int:
        with self.lock:
            return sum(1 for x in self.live.values() if x.engine == engine)

    def _fill(self) -> None:
        """Start what the scheduler admits. With the asyncio runner, on the loop, paced (see
        `_fill_slice`)."""
        if self.stopping or self.fatal is not None:
            return
        if self.runner is None:
            self._launch(self.sched.fill())
        elif not self._filling:
            self._filling = True
            self.runner.in_loop(self._fill_slice)

    # asyncio runner: new episodes start at `rollout.start_rate` per second at most, in
    # slices at least START_GAP_S apart (rollout/pacing.py: each holds the whole groups the
    # rate allows since the previous slice; the first slice of a fill START_BURST_S of it). A
    # batch's worth of groups started at once (512 episodes after a take at 4,096) put tens of
    # milliseconds of work on the loop, every turn in flight waiting behind it
    # (benchmarks/rollout_scale.py's overhead p99); a loop saturated with turns runs slices far
    # apart, and they grow to keep the rate.
    START_GAP_S, START_BURST_S = 0.001, 0.004

    def _fill_slice(self, continued: bool = False) -> None:
        def now() -> None:
            if self.stopping or self.fatal is not None:
                self._filling = False
                return
            groups, started = self._pacer.allowed(time.monotonic(), continued), 0
            if groups:
                before = self.sched.counters["groups_started"]
                self._launch(self.sched.fill(max_groups=groups))
                started = self.sched.counters["groups_started"] - before
                self._pacer.started(started)
            if started < groups:
                self._filling = False  # capacity reached: the next event asks again
            else:  # (no whole group allowed yet: the next slice)
                self.runner.loop.call_later(self.START_GAP_S, self._fill_slice, True)
        self.runner._locked(now)

    def _launch(self, starts: list[Start]) -> None:
        alive = [i for i, ok in enumerate(self.hosts_alive) if ok]
        if starts and not alive:
            self.fatal = RuntimeError("every env host is lost (their workers died)")
            self.lock.notify_all()
            return
        if not starts:
            return
        on_engine, on_host = self.on_engine, self.on_host
        engines = self.health.alive_indices() or range(len(self.batchers))  # else: waits
        new: list[LiveEpisode] = []
        for st in starts:
            live = LiveEpisode(st, engine=min(engines, key=lambda i: on_engine[i]),
                               host=min(alive, key=lambda i: on_host[i]))
            on_engine[live.engine] += 1
            on_host[live.host] += 1
            self.live[st.episode_id] = live
            self._launched[st.episode_id] = next(self._seq)
            if self.runner is None:
                self._spawn(run_episode, self, live, name=f"episode {st.episode_id}")
            else:
                new.append(live)
        if new:
            self.runner.launch(new)

    def _pop_live(self, episode_id: str) -> LiveEpisode | None:
        live = self.live.pop(episode_id, None)
        if live is not None:
            self.on_engine[live.engine] -= 1
            self.on_host[live.host] -= 1
        return live

    def set_fatal(self, err: BaseException, keep_first: bool = True) -> None:
        """The run cannot go on: `try_take` raises `err` (or the first fatal error)."""
        with self.lock:
            self.fatal = (self.fatal or err) if keep_first else err
            self.lock.notify_all()

    def episode_over(self, live: LiveEpisode, traj: Trajectory, timings: dict[str, float],
                     reason: str, locked: Callable[..., None] | None = None) -> bool:
        """The end of an episode under either runner, once its env is closed: True when
        `traj` goes on to its reward. A failed one is recorded as `reason` (`locked` runs
        `_failed` under the service's lock: the asyncio runner's never blocks its loop)."""
        self.routing.episode_end(live.id, live.start.task, traj)
        traj.timings.update(timings)
        if live.cancelled:
            return False  # already accounted for by whoever cancelled it
        if traj.error is None:
            return True
        self.recent_errors.append(f"{live.id}: {traj.error}")
        (locked or (lambda fn, *args: fn(*args)))(self._failed, live, reason, False)
        return False

    def _scored(self, live: LiveEpisode, traj: Trajectory) -> None:
        """`traj` has its reward: it joins its group (or is dropped, late)."""
        with self.lock:
            if live.cancelled or self._pop_live(live.id) is None:
                return
            self.done[live.id] = traj
            self.done_stats[live.id] = traj_stats(traj)
            self._cancel(self.sched.on_finished(live.id, traj.reward))
            if self.sched.discarded:  # it completed a group set aside (resample_uniform)
                self._record_discarded()
            group = self.sched.groups.get(live.start.group_id)
            if live.id in self.done and (group is None or live.id not in group.finished):
                # its group went away meanwhile
                self.done.pop(live.id)
                self.done_stats.pop(live.id)
                self._drop(live.start, "late")
            self.lock.notify_all()
            self._fill()

    def _failed(self, live: LiveEpisode, reason: str, timeout: bool) -> None:
        with self.lock:
            if self._pop_live(live.id) is None:
                return
            live.cancelled = True  # the scheduler counts it (failed / timeouts)
            self._drop(live.start, reason)
            if reason == "engine_error":  # the engine's own error, not the env's
                self.totals.counters["engine_errors"] += 1
            starts, cancels = self.sched.on_failed(live.id, timeout=timeout,
                                                   worker_lost=reason == "host_lost")
            self._cancel(cancels)
            self._launch(starts)
            self._fill()
            if self.sched.halted and self.fatal is None:
                self.fatal = RuntimeError(
                    f"{self.sched.consecutive_failures} episodes failed in a row "
                    f"(rollout.max_consecutive_failures); last errors: "
                    f"{list(self.recent_errors)[-3:]}")
                self.lock.notify_all()

    def _cancel(self, cancels: list[Cancel]) -> None:
        for c in cancels:
            live = self._pop_live(c.episode_id)
            if live is not None:
                live.cancelled = True
                if c.reason != "redundant":  # the scheduler counts redundant cancels itself
                    self.totals.counters[f"cancelled_{c.reason}"] += 1
                self._drop(live.start, c.reason)

    def _drop(self, st: Start, reason: str) -> None:
        self._launched.pop(st.episode_id, None)
        self.totals.drops.append((st.episode_id, st.iteration, reason))

    def _record_discarded(self) -> None:
        for eid, reason in self.sched.discarded:
            traj = self.done.pop(eid, None)
            stats = self.done_stats.pop(eid, None)
            self._launched.pop(eid, None)
            if reason == "uniform" and stats is not None:  # generated, never trained
                self.totals.counters["resampled_model_tokens"] += stats.model_tokens
                self.totals.counters["resampled_env_steps"] += stats.turns
            self.totals.drops.append((eid, traj.iteration if traj else -1, reason))
        self.sched.discarded.clear()

    # ---- metrics -------------------------------------------------------------------------
    def _metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        return service_metrics(self, trajs)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            c = self.totals.counters + self.sched.counters
            c["engines_lost"] = self.health.lost_total
            if self.runner is not None:
                c["gc_collected"] = self.runner.gc_collected
            return {"counters": {k: v for k, v in c.items() if v}, "in_flight": len(self.live),
                    "engines_alive": list(self.health.alive),
                    "engine_events": list(self.health.events),
                    "engine_busy_s": [b.busy_s for b in self.batchers],
                    "engine_calls": [b.calls for b in self.batchers],
                    "hosts_alive": list(self.hosts_alive),
                    "host_events": list(self.host_events),
                    "recent_errors": list(self.recent_errors)}
