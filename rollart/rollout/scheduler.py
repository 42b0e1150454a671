"""Rollout scheduler: a pure state machine, events in, decisions out (no Dask, no clock).

It decides which groups to start, which episodes to keep, cancel or re-issue, and which complete
groups feed each update, under bounded staleness:

    an episode begun under policy version v may feed update u only if u - v <= max_staleness

(update u is the one that turns version u into u + 1; max_staleness = 0 is the synchronous
baseline). Admission control: a group begun now, under `version`, can feed the updates
next_update .. version + max_staleness, so at most that many batches of groups exist at once
(in flight or complete); work is not started that is bound to go stale. With max_staleness = 0
this makes the loop synchronous: nothing starts between taking batch u and the engines serving
version u + 1. With 1, the next batch keeps running while update u trains.

Groups launch `group_size + redundancy` episodes and keep the first `group_size` to finish; the
rest are cancelled. A failed episode is re-issued (same group, same seed) up to `max_retries`
times; a group that can no longer reach `group_size` finishers is dropped. With
`resample_uniform` > 0, a complete group whose episodes all scored alike (zero GRPO advantage: no
gradient) is set aside and a fresh group (new id, new seed) takes its slot in the batch, up to
that many times per slot (dynamic sampling, as DAPO's); the last try is kept whatever it scored.
The same object drives the real rollout service and the simulator.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollart.config.tasks import split_by_share
from rollart.config.training import RolloutConfig, rollout_defaults
from rollart.rollout.ids import sample_id

_ROLLOUT = rollout_defaults()  # the defaults of `rollout.*`, from their one home


@dataclass(frozen=True)
class Start:
    episode_id: str
    group_id: str
    task: str
    seed: int
    version: int  # policy version the episode starts under
    iteration: int = 0  # nominal iteration of the group (group index // batch_groups)


@dataclass(frozen=True)
class Cancel:
    episode_id: str
    reason: str  # "redundant" (group already complete) or "stale" / "group_dropped"


@dataclass
class GroupState:
    group_id: str
    task: str
    seed: int
    start_version: int
    iteration: int = 0
    running: set[str] = field(default_factory=set)
    finished: list[str] = field(default_factory=list)  # in finishing order, at most group_size
    failures: int = 0
    launched: int = 0
    redo: int = 0  # groups of this batch slot set aside before this one (all scored alike)
    first_id: str = ""  # the id of the slot's first group (set on a replacement)
    rewards: list[float | None] = field(default_factory=list)  # of `finished`, in step

    def complete(self, size: int) -> bool:
        return len(self.finished) >= size


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings: `rollout.*` of the run config (`from_rollout`), whose defaults
    are the ones here too (one home: `RolloutConfig`), plus what the run derives (batch groups,
    task shares, a shard's quota, the number of updates)."""

    group_size: int
    batch_groups: int  # complete groups per update
    max_staleness: int = _ROLLOUT["max_staleness"]
    redundancy: int = _ROLLOUT["redundancy"]
    max_retries: int = _ROLLOUT["max_retries"]
    max_updates: int | None = None  # updates the run will take; no group starts after the last
    # this many failures in a row make `halted` true; 0: never
    max_consecutive_failures: int = _ROLLOUT["max_consecutive_failures"]
    task_shares: tuple[tuple[str, float], ...] = (("default", 1.0),)
    # Groups per batch of each task for this scheduler, when it runs one shard of the batch
    # (rollart/rollout/shards.py); None: split `batch_groups` by `task_shares`.
    quota: tuple[tuple[str, int], ...] | None = None
    # A complete group whose episodes all scored alike is replaced this many times at most.
    resample_uniform: int = _ROLLOUT["resample_uniform"]

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, task_shares: tuple[tuple[str, float], ...],
                     max_updates: int | None = None,
                     quota: tuple[tuple[str, int], ...] | None = None) -> SchedulerConfig:
        """The scheduler of a run's `rollout:` section (`batch_groups` = `rollout.num_groups`)."""
        return cls(group_size=rollout.group_size, batch_groups=rollout.num_groups,
                   max_staleness=rollout.max_staleness, redundancy=rollout.redundancy,
                   max_retries=rollout.max_retries, max_updates=max_updates,
                   max_consecutive_failures=rollout.max_consecutive_failures,
                   task_shares=task_shares, quota=quota,
                   resample_uniform=rollout.resample_uniform)


# (task, group index within the task) -> (group id, seed); the rollout service maps them onto
# the iteration plan so that group and sample ids are the planned ones (rollart/rollout/plan.py).
GroupNamer = Callable[[str, int], tuple[str, int]]
# (group id of a batch slot's first group, try k >= 1) -> (id, seed) of its k-th replacement
# (rollart/rollout/plan.py: `plan_resampler`).
Resampler = Callable[[str, int], tuple[str, int]]


def _default_resample(gid: str, redo: int) -> tuple[str, int]:
    """No plan (simulator, unit tests): a suffix on the id, a seed from the id."""
    return f"{gid}.r{redo}", zlib.crc32(f"{gid}.r{redo}".encode())


class RolloutScheduler:
    def __init__(self, cfg: SchedulerConfig, version: int = 0,
                 group_of: GroupNamer | None = None, first_iteration: int = 0,
                 resample_of: Resampler | None = None) -> None:
        self.cfg = cfg
        self.version = version  # latest policy version the engines serve
        self.next_update = version  # the update the next `take_batch` feeds
        self.groups: dict[str, GroupState] = {}
        self._per_task: Counter[str] = Counter()  # groups in `groups` per task, kept in step
        # Groups in `groups` by start version, and those of them not complete yet, kept in step:
        # the trainer polls `take_batch` every few ms, and scanning thousands of groups for
        # stale or unfinished ones each time cost more than the rest of the service's work.
        self._versions: Counter[int] = Counter()
        self._open: Counter[int] = Counter()
        self.complete: list[str] = []  # complete, unconsumed group ids, in completion order
        self.episode_group: dict[str, str] = {}
        self.counters: Counter[str] = Counter()
        # Finished episodes of dropped groups, (episode id, reason): never used, to be recorded.
        self.discarded: list[tuple[str, str]] = []
        names = [t for t, _ in cfg.task_shares]
        # Groups per batch of each task (largest remainder over the shares).
        self.quota = dict(cfg.quota) if cfg.quota is not None else dict(zip(
            names, split_by_share(cfg.batch_groups, [w for _, w in cfg.task_shares]), strict=True))
        self._next_group = 0
        # Per-task group counters; resuming at iteration i continues the plan from there.
        self._task_counts: Counter[str] = Counter(
            {t: first_iteration * q for t, q in self.quota.items()})
        self._namer = group_of
        self._resample_of = resample_of or _default_resample
        self._pending: list[Start] = []  # members of replacement groups, for the next `fill`
        self.consecutive_failures = 0  # failed episodes since the last one that finished

    @property
    def halted(self) -> bool:
        """Every recent episode failed: retrying further would only spin (prime-rl halts too)."""
        limit = self.cfg.max_consecutive_failures
        return limit > 0 and self.consecutive_failures >= limit

    # ---- admission -----------------------------------------------------------------------
    def _usable_batches(self) -> int:
        """Batches of groups that may exist (in flight or complete, unconsumed). A group begun
        now, under `version`, can feed updates next_update .. version + max_staleness; keep
        just enough groups for those batches, so none is started that is bound to go stale."""
        last = self.version + self.cfg.max_staleness
        if self.cfg.max_updates is not None:
            last = min(last, self.cfg.max_updates - 1)  # the run's last update
        return max(0, last - self.next_update + 1)

    def fill(self, max_groups: int | None = None) -> list[Start]:
        """Start new groups up to capacity under the current version, per task: each task keeps
        its share of every batch in flight, so a slow task is never crowded out. At most
        `max_groups` groups per call when given (a caller that starts a batch's worth in
        slices calls again until fewer come back)."""
        out: list[Start] = []
        if self.halted:
            return out
        out, self._pending = self._pending, []  # replacements hold their slots already
        usable = self._usable_batches()
        started = 0
        for task, quota in self.quota.items():
            have = self._per_task[task]
            while have < usable * quota and (max_groups is None or started < max_groups):
                started += 1
                n = self._task_counts[task]  # this task's group index (plan order)
                if self._namer is not None:
                    gid, seed = self._namer(task, n)
                else:
                    # no plan (simulator, unit tests): run-wide sequence numbers
                    gid, seed = f"g{self._next_group}", self._next_group
                self._next_group += 1
                self._task_counts[task] += 1
                g = GroupState(gid, task, seed, self.version, n // quota)
                self._add(g)
                for _ in range(self.cfg.group_size + self.cfg.redundancy):
                    out.append(self._launch(g))
                self.counters["groups_started"] += 1
                have += 1
        return out

    def _launch(self, g: GroupState) -> Start:
        eid = sample_id(g.group_id, g.launched)  # the planned sample id
        g.launched += 1
        g.running.add(eid)
        self.episode_group[eid] = g.group_id
        self.counters["episodes_started"] += 1
        return Start(eid, g.group_id, g.task, g.seed, g.start_version, g.iteration)

    # ---- episode events ------------------------------------------------------------------
    def on_finished(self, episode_id: str, reward: float | None = None) -> list[Cancel]:
        """`episode_id` ended with `reward` (None: not known yet, never a reason to resample).
        A group it completes whose rewards are all equal may be replaced (`resample_uniform`):
        its members go to `discarded` as "uniform", and the replacement's to the next `fill`."""
        g = self._group_of(episode_id)
        if g is None or episode_id not in g.running:
            self.counters["late_results"] += 1  # cancelled or dropped earlier: ignore
            return []
        g.running.discard(episode_id)
        self.consecutive_failures = 0
        if g.complete(self.cfg.group_size):
            return []
        g.finished.append(episode_id)
        g.rewards.append(reward)
        self.counters["episodes_finished"] += 1
        if not g.complete(self.cfg.group_size):
            return []
        self._open[g.start_version] -= 1
        if self._uniform(g) and g.redo < self.cfg.resample_uniform:
            return self._resample(g)  # its redundant members are cancelled as "uniform"
        self.complete.append(g.group_id)
        cancels = [Cancel(e, "redundant") for e in sorted(g.running)]
        self.counters["cancelled_redundant"] += len(cancels)
        for e in cancels:
            g.running.discard(e.episode_id)
            self.episode_group.pop(e.episode_id, None)  # a late result is ignored either way
        return cancels

    @staticmethod
    def _uniform(g: GroupState) -> bool:
        """Every reward known and equal: the group's GRPO advantages are all 0."""
        return None not in g.rewards and len(set(g.rewards)) == 1

    def _resample(self, g: GroupState) -> list[Cancel]:
        """Set complete group `g` aside (its episodes to `discarded`, "uniform") and start the
        next try of its batch slot under the current version: same task and iteration, a
        new id and seed. The replacement is added at once, so `fill` starts no other group in
        its place."""
        cancels = self._drop(g, "uniform")
        first = g.first_id or g.group_id
        gid, seed = self._resample_of(first, g.redo + 1)
        new = GroupState(gid, g.task, seed, self.version, g.iteration, redo=g.redo + 1,
                         first_id=first)
        self._add(new)
        self._pending += [self._launch(new)
                          for _ in range(self.cfg.group_size + self.cfg.redundancy)]
        self.counters["groups_resampled"] += 1
        return cancels

    def on_failed(self, episode_id: str, timeout: bool = False, worker_lost: bool = False
                  ) -> tuple[list[Start], list[Cancel]]:
        """An episode raised, hung past its timeout, or lost its worker: re-issue or give up.
        A lost worker's episodes do not count towards `halted` (a whole host's episodes fail
        at once, and they are re-issued on the others)."""
        g = self._group_of(episode_id)
        if g is None or episode_id not in g.running:
            return [], []
        g.running.discard(episode_id)
        g.failures += 1
        self.consecutive_failures += 0 if worker_lost else 1
        self.counters["timeouts" if timeout else "failed"] += 1
        if g.complete(self.cfg.group_size) or self.halted:
            return [], []
        # Retry budget per group: max_retries re-issues per member slot.
        if g.failures <= self.cfg.max_retries * self.cfg.group_size:
            still_needed = self.cfg.group_size - len(g.finished)
            if len(g.running) < still_needed:
                self.counters["retried"] += 1
                return [self._launch(g)], []
            return [], []
        self.counters["groups_dropped_failures"] += 1  # its retry budget is spent
        return [], self._drop(g, "group_dropped")

    # ---- versions and batches -----------------------------------------------------------
    def on_version(self, version: int) -> list[Cancel]:
        """Engines now serve `version`; drop groups that can no longer feed any future update."""
        self.version = version
        return self._drop_stale(update=version)

    def take_batch(self, update: int) -> dict[str, list[str]] | None:
        """{group id: kept episode ids} for update `update` (complete groups begun under the
        oldest version first, then in completion order), or None while a task's share is not
        complete or a group that expires at this update still runs. Groups already past the
        bound (the engines moved on without consuming them) are dropped and counted first."""
        self._drop_stale(update)
        # A group that could feed no later update (begun max_staleness versions ago) is waited
        # for, not dropped: dropping it would bias batches towards groups that finish fast (in
        # FrozenLake: short episodes, i.e. failures). Measured: benchmarks/async_vs_sync.py.
        if any(n > 0 and update - v >= self.cfg.max_staleness for v, n in self._open.items()):
            return None
        if len(self.complete) < sum(self.quota.values()):
            return None  # not enough complete groups for any task split
        # Each task its share of the batch; within a task the groups begun under the oldest
        # version first (they go stale first), then completion order.
        ready = sorted(self.complete, key=lambda gid: self.groups[gid].start_version)
        picked: set[str] = set()
        for task, n in self.quota.items():
            picks = [gid for gid in ready if self.groups[gid].task == task][:n]
            if len(picks) < n:
                return None  # this task's share is not complete yet
            picked.update(picks)
        batch = [gid for gid in ready if gid in picked]
        self.complete = [gid for gid in ready if gid not in picked]
        self.counters["groups_consumed"] += len(batch)
        self.next_update = update + 1
        out = {gid: self._remove(self.groups[gid], prune=False).finished for gid in batch}
        self._prune_versions()
        return out

    def _drop_stale(self, update: int) -> list[Cancel]:
        cancels: list[Cancel] = []
        if not any(n > 0 and update - v > self.cfg.max_staleness
                   for v, n in self._versions.items()):
            return cancels  # the common case, without a scan of every group
        for g in list(self.groups.values()):
            if update - g.start_version > self.cfg.max_staleness:
                self.counters["dropped_stale_groups"] += 1
                cancels += self._drop(g, "stale")
        return cancels

    def _add(self, g: GroupState) -> None:
        self.groups[g.group_id] = g
        self._per_task[g.task] += 1
        self._versions[g.start_version] += 1
        self._open[g.start_version] += not g.complete(self.cfg.group_size)

    def _remove(self, g: GroupState, prune: bool = True) -> GroupState:
        """`prune=False`: the caller removes many groups and calls `_prune_versions` once."""
        del self.groups[g.group_id]
        self._per_task[g.task] -= 1
        self._versions[g.start_version] -= 1
        self._open[g.start_version] -= not g.complete(self.cfg.group_size)
        if prune:
            self._prune_versions()
        for e in (*g.finished, *g.running):  # a late event of theirs finds no group either way
            self.episode_group.pop(e, None)
        return g

    def _prune_versions(self) -> None:
        for v in [v for v, n in self._versions.items() if n <= 0]:  # at most a few versions
            del self._versions[v]
            self._open.pop(v, None)

    def _drop(self, g: GroupState, reason: str) -> list[Cancel]:
        if self.groups.get(g.group_id) is g:
            self._remove(g)
        if g.group_id in self.complete:
            self.complete.remove(g.group_id)
        self.counters[f"dropped_{reason}_episodes"] += len(g.finished)
        self.discarded += [(e, reason) for e in g.finished]
        return [Cancel(e, reason) for e in sorted(g.running)]

    # ---- checkpoint state (rollart/rollout/snapshot.py) ----------------------------------
    def export_state(self) -> dict[str, Any]:
        """Unconsumed groups (complete or not) and the plan cursor, JSON-ready."""
        return {"groups": [{"group_id": g.group_id, "task": g.task, "seed": g.seed,
                            "start_version": g.start_version, "iteration": g.iteration,
                            "launched": g.launched, "failures": g.failures,
                            "finished": list(g.finished), "running": sorted(g.running),
                            "redo": g.redo, "first_id": g.first_id,
                            "rewards": list(g.rewards)}
                           for g in self.groups.values()],
                "complete": list(self.complete),
                "task_counts": dict(self._task_counts), "next_group": self._next_group}

    def import_state(self, state: dict[str, Any]) -> list[Start]:
        """Put exported groups back (a fresh scheduler of a resumed run). Returns the members
        to launch so that unfinished groups can still complete: new ids, since `launched`
        continues (the old running ones are the caller's to drop)."""
        starts: list[Start] = []
        for d in state["groups"]:
            g = GroupState(d["group_id"], d["task"], int(d["seed"]), int(d["start_version"]),
                           int(d["iteration"]), finished=list(d["finished"]),
                           failures=int(d["failures"]), launched=int(d["launched"]),
                           redo=int(d.get("redo", 0)), first_id=str(d.get("first_id", "")),
                           # older snapshots: rewards unknown, so never resampled
                           rewards=list(d.get("rewards", [None] * len(d["finished"]))))
            old = self.groups.get(g.group_id)
            if old is not None:
                self._remove(old)
            self._add(g)
            for e in g.finished:
                self.episode_group[e] = g.group_id
            if not g.complete(self.cfg.group_size):
                starts += [self._launch(g) for _ in range(self.cfg.group_size - len(g.finished))]
        self.complete = [gid for gid in state["complete"] if gid in self.groups]
        self._task_counts = Counter({str(k): int(v) for k, v in state["task_counts"].items()})
        self._next_group = int(state["next_group"])
        return starts

    def _group_of(self, episode_id: str) -> GroupState | None:
        return self.groups.get(self.episode_group.get(episode_id, ""))
