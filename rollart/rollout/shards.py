"""A sharded rollout service: N RolloutService shards, each owning a partition of the groups.

Every batch has `rollout.num_groups` group slots, split across tasks by share (task t: q_t slots,
slot s of iteration i is group `{t}/i{i}/g{s}`). The slots, listed task by task, are dealt to the
shards round-robin, so shard k of n owns the same slots of every iteration (a partition of the
plan's group ids: a sharded run names and seeds its groups exactly as an unsharded one). Each
shard runs its own pure `RolloutScheduler` over its slots (`SchedulerConfig.quota`), so the
scheduler's rules hold per group, unchanged:

- staleness: a group begun under version v feeds update u only if u - v <= max_staleness (every
  shard hears every `set_version`; a shard's part of update u obeys the bound, so the union does);
- admission: each shard keeps at most `usable` batches of its own slots, so all shards together
  keep at most `usable` batches of `num_groups` groups (the unsharded cap);
- redundancy and retries are per group, and a group lives on exactly one shard;
- shares: each task's q_t slots are split across the shards, so every batch still holds q_t
  groups of task t.

Each shard talks to every engine replica through its own router (its own view of the replicas'
load: the turns of the other shards reach a replica's queue but not this router's estimate).
`ShardedRollout` is the trainer's side, with the rollout service's interface (the driver, the
stages and the engine supervisor use either alike): `take_batch(u)` gathers each shard's part of
update u (holding the parts that are ready until all are); `set_version`, engine losses and
replacements reach every shard; a checkpoint's rollout state is every shard's snapshot, and a
resume gives each shard its own (the same `rollout.shards` is required).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollart.config import RunConfig
from rollart.handles import call
from rollart.metrics import rollout_metrics
from rollart.rollout.scheduler import split_by_share
from rollart.types import Trajectory

if TYPE_CHECKING:
    from rollart.service_protocols import RolloutAPI

GroupNamer = Callable[[str, int], tuple[str, int]]
Batch = tuple[list[Trajectory], dict[str, Any]]
SHARDED_FORMAT = "sharded"  # rollout_state.json of a sharded run: {"format", "shards": [...]}


def check_state_shards(state: dict[str, Any], shards: int) -> None:
    """A checkpoint's rollout state (a sharded one, or one service's) resumes only into the
    same number of shards: else fail before anything starts, naming the value to use."""
    n = len(state["shards"]) if state.get("format") == SHARDED_FORMAT else 1
    if n != shards:
        raise ValueError(f"the checkpoint's rollout state comes from {n} rollout shard(s), "
                         f"this run has rollout.shards={shards}: resume with "
                         f"rollout.shards={n}")


def shard_slots(cfg: RunConfig, shard: int, shards: int) -> dict[str, list[int]]:
    """{task: the slots (group index within an iteration) shard `shard` of `shards` owns}."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < shards")
    if shards > cfg.rollout.num_groups:
        raise ValueError(f"{shards} rollout shards but rollout.num_groups is "
                         f"{cfg.rollout.num_groups}: a shard needs at least one group per batch")
    counts = split_by_share(cfg.rollout.num_groups, [t.share for t in cfg.tasks])
    dealt = [(t.name, s) for t, q in zip(cfg.tasks, counts, strict=True) for s in range(q)]
    out: dict[str, list[int]] = {t.name: [] for t in cfg.tasks}
    for j, (task, slot) in enumerate(dealt):
        if j % shards == shard:
            out[task].append(slot)
    return out


def shard_quota(cfg: RunConfig, shard: int, shards: int) -> tuple[tuple[str, int], ...]:
    """Groups per batch of each task on this shard (SchedulerConfig.quota)."""
    return tuple((t, len(s)) for t, s in shard_slots(cfg, shard, shards).items())


def shard_namer(cfg: RunConfig, namer: GroupNamer, shard: int, shards: int) -> GroupNamer:
    """The shard scheduler's m-th group of a task -> the plan's group of the slot it owns:
    iteration m // q_k, slot slots[m % q_k]; `namer` names the plan's n-th group of a task."""
    slots = shard_slots(cfg, shard, shards)
    quota = dict(zip((t.name for t in cfg.tasks),
                     split_by_share(cfg.rollout.num_groups, [t.share for t in cfg.tasks]),
                     strict=True))

    def name(task: str, m: int) -> tuple[str, int]:
        mine = slots[task]
        iteration, r = divmod(m, len(mine))
        return namer(task, iteration * quota[task] + mine[r])

    return name


# Metrics that are counts over the run or the batch: summed over the shards (the rest of a
# shard's metrics are averaged, and the batch's own statistics recomputed over the whole batch).
_SUMMED = ("timeouts", "retried", "cancelled_redundant", "cancelled_stale",
           "cancelled_group_dropped", "groups_dropped_failures", "dropped_stale_groups",
           "hosts_lost", "late_results", "engine_errors", "turns_reissued", "engines_replaced",
           "failed", "failed_total", "dropped_stale_episodes", "in_flight", "groups_ready")


class ShardedRollout:
    """The trainer's side of `shards` (RolloutService objects or actors with the same methods:
    try_take, set_version, start, stop, stats), with RolloutService's own take semantics."""

    def __init__(self, shards: list[RolloutAPI]) -> None:
        self.shards = shards
        self._parts: dict[int, dict[int, Batch]] = {}
        self._taken: tuple[int, Batch] | None = None

    def map_handles(self, fn: Callable[[Any], Any]) -> ShardedRollout:
        """The same shards, each handle mapped by `fn` (rollart.handles.detach / attach /
        release: a stage's arguments carry the shards' refs, not their actors); the parts
        held for an unfinished take stay with this object."""
        return ShardedRollout([fn(s) for s in self.shards])

    def start(self) -> None:
        for s in self.shards:
            call(s).start()

    def try_take(self, update: int) -> Batch | None:
        """Every shard's part of update `update`, joined in shard order, or None while one is
        missing (the parts already taken wait here). Asked again for the update it last
        answered, it answers the same (as RolloutService.try_take)."""
        if self._taken is not None and self._taken[0] == update:
            return self._taken[1]
        parts = self._parts.setdefault(update, {})
        for i, s in enumerate(self.shards):
            if i not in parts and (out := call(s).try_take(update)) is not None:
                parts[i] = out
        if len(parts) < len(self.shards):
            return None
        del self._parts[update]
        ordered = [parts[i] for i in range(len(self.shards))]
        trajs = [t for p in ordered for t in p[0]]
        info = {"dropped": [d for p in ordered for d in p[1]["dropped"]],
                "metrics": merge_metrics([p[1]["metrics"] for p in ordered], trajs),
                "shards": len(ordered)}
        self._taken = (update, (trajs, info))
        return self._taken[1]

    def take_batch(self, update: int, timeout: float | None = None, poll_s: float = 0.02
                   ) -> Batch:
        t0 = time.perf_counter()
        while (out := self.try_take(update)) is None:
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"no complete batch for update {update} in {timeout} s")
            time.sleep(poll_s)
        out[1]["metrics"]["rollout/wait_s"] = time.perf_counter() - t0
        return out

    def set_version(self, version: int) -> None:
        for s in self.shards:
            call(s).set_version(version)

    def lost_engines(self) -> list[int]:
        """Replicas any shard has lost (each shard hears of a loss from its own calls)."""
        return sorted({i for s in self.shards for i in call(s).lost_engines()})

    def replace_engine(self, index: int, engine: Any) -> None:
        for s in self.shards:
            call(s).replace_engine(index, engine)

    def snapshot(self) -> tuple[bytes | None, list[Trajectory]]:
        """Every shard's unconsumed groups (rollart/rollout/snapshot.py), in one state; (None,
        []) when no shard holds any (a synchronous run)."""
        parts = [call(s).snapshot() for s in self.shards]
        if all(state is None for state, _ in parts):
            return None, []
        doc = {"format": SHARDED_FORMAT,
               "shards": [None if state is None else json.loads(state) for state, _ in parts]}
        return (json.dumps(doc, sort_keys=True).encode(),
                [t for _, trajs in parts for t in trajs])

    def restore_state(self, state: bytes, trajs: list[Trajectory]) -> dict[str, int]:
        """Each shard gets its own part of a sharded snapshot (before `start`)."""
        doc = json.loads(state)
        check_state_shards(doc, len(self.shards))
        by_id = {t.sample_id: t for t in trajs}
        out: Counter[str] = Counter()
        for s, part in zip(self.shards, doc["shards"], strict=True):
            if part is not None:
                mine = [by_id[e] for g in part["groups"] for e in g["finished"] if e in by_id]
                out.update(call(s).restore_state(json.dumps(part, sort_keys=True).encode(),
                                                  mine))
        return dict(out)

    def stats(self) -> dict[str, Any]:
        per = [call(s).stats() for s in self.shards]
        counters: Counter[str] = Counter()
        for p in per:
            counters.update(p["counters"])
        return {"counters": dict(counters), "in_flight": sum(p["in_flight"] for p in per),
                "shards": per}

    def stop(self) -> dict[str, Any]:
        """Stops every shard, even when one cannot be reached (a lost worker: the run aborts
        and restarts, and the others must not go on running episodes); then raises the first
        error."""
        out, errors = [], []
        for s in self.shards:
            try:
                out.append(call(s).stop())
            except Exception as err:  # noqa: BLE001 - raised below, after the others stopped
                errors.append(err)
        if errors:
            raise errors[0]
        counters: Counter[str] = Counter()
        for p in out:
            counters.update(p["counters"])
        return {"counters": dict(counters), "shards": out}


def merge_metrics(parts: list[dict[str, float]], trajs: list[Trajectory]) -> dict[str, float]:
    keys = {k for p in parts for k in p}
    out = {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys}
    for key in _SUMMED:
        name = f"rollout/{key}"
        if name in keys:
            out[name] = sum(p.get(name, 0.0) for p in parts)
    out["perf/engine_busy_s"] = sum(p.get("perf/engine_busy_s", 0.0) for p in parts)
    if "rollout/start_version_min" in keys:
        out["rollout/start_version_min"] = min(p.get("rollout/start_version_min", float("inf"))
                                               for p in parts)
    out.update(rollout_metrics(trajs))
    return out
