"""Router: picks the engine replica for each generation request. Pure: events in, decisions out.

Cost model (per request, on hardware class c):

    service_s(c) = prefill_tokens * flops_per_token / FLOP/s(c)
                 + decode_tokens  * bytes_per_token / bandwidth(c)

with flops_per_token ~ 2 x params and bytes_per_token ~ param bytes / decode batch (+ KV reads):
a decode step reads every weight once for the whole batch, so each row pays its share.
`prefill_tokens` is the turn's new tokens on the replica that holds the episode's prefix (when the
engine caches prefixes) and new + context tokens anywhere else (cache miss).

Batching: an engine serves its queue in batches of `decode_batch` rows; a batch's decode steps
run until its longest row is done, each step reading the weights once:

    batch_s(c) = sum of its prefill_tokens * flops_per_token / FLOP/s(c)
               + max of its decode_tokens * (decode_batch * bytes_per_token) / bandwidth(c)

A replica's wait is batch_s summed over its outstanding requests cut into batches in arrival
order, and a request's service time on a replica is what it adds to that (its marginal cost).
For a full batch of equal rows this is the per-request sum above; a decode-heavy request that
joins a batch of short ones costs the whole batch its long decode (issue 21: without this the
router put decode-heavy turns next to prefill-heavy ones on the compute pool, where every such
batch ran 128 weight-bound steps instead of 8, and affinity lost to round robin).

Online correction: peak figures are never reached (MFU/MBU, attention, padding, host overheads).
When the caller reports a finished engine batch (`on_batch(replica, request_ids, busy_s)`), the
replica's ratio becomes an EMA of measured busy time / estimated time of that batch. The estimate
for replica i is multiplied by

    scale_i = g * clamp(ratio_i / g, 1 / b, b),    g = geometric mean of the measured ratios

g (`router/correction/common`) is what every replica shares (the engine software's efficiency,
the emulation's time scale, a host's load): it multiplies every candidate alike, so it never
changes which replica is cheapest, only how waits compare with the stickiness threshold. The
per-replica part is bounded by b (`correction_bound`): two replicas' estimates can move against
each other by at most b^2, and the default b = (smallest ratio between the pools' FLOP/s or
bandwidths)^(1/4) keeps that below the square root of the smallest class advantage (H800 vs H20:
bandwidth 4000/3350 = 1.194, b = 1.0453, at most 1.0927 of relative correction), so a pure
prefill turn stays on the compute class and a pure decode turn on the bandwidth class whatever
the measurements say. Replicas of one class only: b = 2.

Why it must be bounded (issue 21): with one unbounded scalar per replica, the measured batch
times of two emulated replicas sharing a CPU host carried the *other* replica's load (both
competed for the same cores and the GIL, and the old emulation multiplied the stretched compute
time by its slowdown), so the scales (4.1-6.5 between repeats) tracked contention, not hardware.
A ratio of two such scales beyond 1.19 (the H20's whole decode advantage) flips decode-heavy
turns to the H800; beyond ~4 it flips prefill-heavy ones too; and a replica that had not reported
yet kept scale 1, so it looked several times faster than the measured ones. Placements then
followed the noise (in one repeat the decision counts equalled round robin's).

Policies (what a new episode, or a spilled one, gets):
  affinity      argmin over healthy replicas of wait + service_s on that replica's class, plus
                the delay it would inflict on the k queued rows it would share a batch with
                (k x service_s): the sum of turn completion times. A decode-heavy turn that
                would stretch a batch of short prefill-heavy turns from 8 to 128 steps (or a
                prefill-heavy one that would make a batch wait for a 6.7x slower prefill)
                then goes where it batches with its like; with decode_batch 1 it is plain
                earliest finish.
  round_robin   the next healthy replica in a fixed rotation
  least_loaded  the healthy replica with the fewest outstanding requests (class-blind)

Stickiness: a later turn of an episode goes back to the replica that served the previous turn
(its prefix is cached there). affinity leaves it only if another replica would finish the turn
(wait + service, the home's service counting the cached prefix) more than
`imbalance_threshold_s` sooner ("spill"); with an engine that caches nothing the home has no
advantage in that comparison, only the threshold's hysteresis (issue 21: a prefill-heavy
episode first placed on the bandwidth pool while the compute pool was busy stayed there for all
its turns, each longer than the last). The class-blind baselines keep the home unless its wait
exceeds the smallest wait by more than the threshold; then the policy decides again. Failed
replicas are never chosen; an episode whose replica failed is re-placed ("failover").

The caller reports: `route` when a request is ready, `on_started` when an engine batch takes it
(optional, sharpens the batch model), `on_finished` when its completion is back,
`on_episode_end` when an episode is done, `on_failed` / `on_recovered` for replica health.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from rollart.routing.catalog import HardwareClass

Policy = Literal["affinity", "round_robin", "least_loaded"]
POLICIES: tuple[str, ...] = ("affinity", "round_robin", "least_loaded")


SAME_CLASS_BOUND = 2.0  # correction bound when every replica has the same figures


def default_correction_bound(classes: Iterable[HardwareClass]) -> float:
    """(smallest ratio > 1 between two replicas' FLOP/s or bandwidths) ** (1/4): the relative
    correction between two replicas (at most bound^2) then stays below the square root of the
    smallest class advantage. H800 + H20: (4000 / 3350) ** 0.25 = 1.0453."""
    ratios = [max(x, y) / min(x, y)
              for a, c in itertools.combinations(list(classes), 2)
              for x, y in ((a.flops, c.flops), (a.bandwidth, c.bandwidth)) if x != y]
    return min(ratios) ** 0.25 if ratios else SAME_CLASS_BOUND


class NoHealthyReplica(RuntimeError):
    """Every replica is marked failed."""


@dataclass(frozen=True)
class CostModel:
    flops_per_token: float  # prefill FLOPs per prompt token
    bytes_per_token: float  # decode bytes read per generated token (weights' share + KV)
    time_scale: float = 1.0  # wall seconds per modelled second (emulation's time_scale)
    decode_batch: int = 1  # rows per engine batch (they share each decode step's weight read)

    @classmethod
    def for_model(cls, params: float, bytes_per_param: float = 2.0, decode_batch: int = 1,
                  kv_bytes_per_token: float = 0.0, time_scale: float = 1.0) -> CostModel:
        """params: parameter count; bytes_per_param: 2 for bf16; decode_batch: rows that share one
        weight read per decode step; kv_bytes_per_token: KV bytes read per generated token."""
        return cls(flops_per_token=2.0 * params,
                   bytes_per_token=params * bytes_per_param / max(decode_batch, 1)
                   + kv_bytes_per_token, time_scale=time_scale,
                   decode_batch=max(decode_batch, 1))

    def service_s(self, hw: HardwareClass, prefill_tokens: float, decode_tokens: float) -> float:
        return self.time_scale * (prefill_tokens * self.flops_per_token / hw.flops
                                  + decode_tokens * self.bytes_per_token / hw.bandwidth)

    def batch_s(self, hw: HardwareClass, items: Iterable[tuple[float, float]]) -> float:
        """(prefill tokens, decode tokens) of requests served in this order, `decode_batch` rows
        per batch: each batch's prefill plus its longest decode at a full step per token."""
        rows = list(items)
        step = self.decode_batch * self.bytes_per_token / hw.bandwidth
        total = 0.0
        for i in range(0, len(rows), self.decode_batch):
            chunk = rows[i:i + self.decode_batch]
            total += (sum(p for p, _ in chunk) * self.flops_per_token / hw.flops
                      + max(d for _, d in chunk) * step)
        return self.time_scale * total


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str
    hw: HardwareClass


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    episode_id: str
    task: str
    new_tokens: int  # prompt tokens added since the episode's previous turn (all of turn 1)
    context_tokens: int = 0  # prompt tokens before those (the episode's cacheable prefix)
    decode_tokens: float = 0.0  # expected tokens to generate (TaskProfiles.expected_decode_tokens)


@dataclass(frozen=True)
class Decision:
    request_id: str
    replica_id: str
    replica_index: int  # position of the replica in the list the router was built with
    hw_class: str
    reason: Literal["new", "sticky", "spill", "failover"]
    est_service_s: float
    est_wait_s: float  # the replica's wait before this request was added


@dataclass
class _Replica:
    spec: ReplicaSpec
    failed: bool = False
    # request id -> (prefill tokens, decode tokens), in arrival order
    outstanding: dict[str, tuple[float, float]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)  # outstanding ids already in an engine batch
    ratio: float = 1.0  # EMA of measured / estimated batch time (unbounded)
    scale: float = 1.0  # the correction applied: common part x bounded relative part
    batches: int = 0


class Router:
    def __init__(self, replicas: list[ReplicaSpec], cost: CostModel, *,
                 policy: Policy = "affinity", sticky: bool = True,
                 imbalance_threshold_s: float = 1.0, prefix_cache: bool = True,
                 correction_alpha: float = 0.3, correction_bound: float | None = None):
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {POLICIES}")
        if not replicas:
            raise ValueError("the router needs at least one replica")
        ids = [r.replica_id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique, got {ids}")
        if imbalance_threshold_s < 0:
            raise ValueError("imbalance_threshold_s must be >= 0")
        self.cost = cost
        self.policy: Policy = policy
        self.sticky = sticky
        self.imbalance_threshold_s = imbalance_threshold_s
        self.prefix_cache = prefix_cache
        self.correction_alpha = correction_alpha  # 0 disables the online correction
        if correction_bound is not None and correction_bound < 1.0:
            raise ValueError(f"correction_bound must be >= 1, got {correction_bound}")
        self.correction_bound = (correction_bound if correction_bound is not None
                                 else default_correction_bound([r.hw for r in replicas]))
        self.common_scale = 1.0
        self._raw: dict[str, tuple[float, float]] = {}  # outstanding id -> tokens (on_batch)
        self._replicas: dict[str, _Replica] = {r.replica_id: _Replica(r) for r in replicas}
        self._order = ids  # round-robin rotation order
        self._index = {rid: i for i, rid in enumerate(ids)}
        self._rr = 0
        self._home: dict[str, str] = {}  # episode id -> replica that served its last turn
        self._where: dict[str, str] = {}  # outstanding request id -> replica id
        self._counts: dict[str, float] = {"sticky": 0.0, "spill": 0.0, "failover": 0.0,
                                          "new": 0.0}
        self._routed: dict[str, float] = {i: 0.0 for i in ids}

    # ---------------------------------------------------------------- queries

    def replica_ids(self) -> list[str]:
        return list(self._order)

    def healthy(self) -> list[str]:
        return [i for i in self._order if not self._replicas[i].failed]

    def wait_s(self, replica_id: str) -> float:
        rep = self._replicas[replica_id]
        hw = rep.spec.hw
        running = [v for k, v in rep.outstanding.items() if k in rep.running]
        queued = self._queued(rep)
        return rep.scale * (self.cost.batch_s(hw, running) + self.cost.batch_s(hw, queued))

    @staticmethod
    def _queued(rep: _Replica) -> list[tuple[float, float]]:
        return [v for k, v in rep.outstanding.items() if k not in rep.running]

    def home(self, episode_id: str) -> str | None:
        return self._home.get(episode_id)

    def service_s(self, req: RouteRequest, replica_id: str) -> float:
        """Estimated service time of `req` on `replica_id` (a cache hit only on the episode's
        home replica, and only when the engines cache prefixes)."""
        return self._replicas[replica_id].scale * self._raw_service_s(req, replica_id)

    def _tokens(self, req: RouteRequest, replica_id: str) -> tuple[float, float]:
        hit = self.prefix_cache and self._home.get(req.episode_id) == replica_id
        return req.new_tokens + (0 if hit else req.context_tokens), req.decode_tokens

    def _raw_service_s(self, req: RouteRequest, replica_id: str) -> float:
        """What `req` adds to the replica's queued work (batched), before the correction."""
        rep = self._replicas[replica_id]
        queued = self._queued(rep)  # a running batch takes no new rows
        item = self._tokens(req, replica_id)
        return (self.cost.batch_s(rep.spec.hw, [*queued, item])
                - self.cost.batch_s(rep.spec.hw, queued))

    # ---------------------------------------------------------------- events

    def route(self, req: RouteRequest) -> Decision:
        if req.request_id in self._where:
            raise ValueError(f"request {req.request_id!r} is already routed")
        healthy = self.healthy()
        if not healthy:
            raise NoHealthyReplica("every engine replica is marked failed")
        home = self._home.get(req.episode_id)
        reason: Literal["new", "sticky", "spill", "failover"]
        if home is None:
            reason, choice = "new", self._pick(req, healthy)
        elif self._replicas[home].failed:
            reason, choice = "failover", self._pick(req, healthy)
        elif not self.sticky:
            choice = self._pick(req, healthy)
            reason = "sticky" if choice == home else "spill"
        elif self.policy == "affinity":
            # cost-aware stickiness: the home's cached prefix is in its service estimate, so
            # stay unless another replica finishes this turn more than the threshold sooner.
            best = self._pick(req, healthy)
            gain = self._finish_s(req, home) - self._finish_s(req, best)
            reason, choice = (("spill", best) if best != home
                              and gain > self.imbalance_threshold_s else ("sticky", home))
        else:
            imbalance = self.wait_s(home) - min(self.wait_s(i) for i in healthy)
            if imbalance <= self.imbalance_threshold_s:
                reason, choice = "sticky", home
            else:
                # round robin has no notion of "better", so a spill must leave the overloaded
                # replica; the cost-aware policies may keep it if it still finishes first.
                cands = healthy
                if self.policy == "round_robin":
                    cands = [i for i in healthy if i != home]
                choice = self._pick(req, cands)
                reason = "sticky" if choice == home else "spill"
        est = self._raw_service_s(req, choice) * self._replicas[choice].scale
        wait = self.wait_s(choice)
        item = self._tokens(req, choice)
        self._replicas[choice].outstanding[req.request_id] = item
        self._raw[req.request_id] = item
        self._where[req.request_id] = choice
        self._home[req.episode_id] = choice
        self._counts[reason] += 1
        self._routed[choice] += 1
        return Decision(req.request_id, choice, self._index[choice],
                        self._replicas[choice].spec.hw.name, reason, est, wait)

    def on_started(self, replica_id: str, request_ids: list[str]) -> None:
        """An engine batch with `request_ids` started on `replica_id` (optional: without it every
        outstanding request counts as queued, and a new one may be estimated to join a batch
        that is already running)."""
        rep = self._replicas[replica_id]
        rep.running.update(r for r in request_ids if r in rep.outstanding)

    def on_finished(self, request_id: str) -> None:
        """The completion is back (or the request was aborted): its work leaves the queue."""
        rid = self._where.pop(request_id, None)
        self._raw.pop(request_id, None)
        if rid is not None:
            self._replicas[rid].outstanding.pop(request_id, None)
            self._replicas[rid].running.discard(request_id)

    def on_batch(self, replica_id: str, request_ids: list[str], busy_s: float) -> None:
        """An engine call on `replica_id` served `request_ids` in `busy_s` seconds: update the
        replica's measured/estimated scale. Call it before their `on_finished`."""
        rep = self._replicas[replica_id]
        items = [self._raw.pop(r) for r in request_ids if r in self._raw]
        raw = self.cost.batch_s(rep.spec.hw, items) if items else 0.0
        if raw <= 0.0 or busy_s <= 0.0 or self.correction_alpha <= 0.0:
            return
        ratio = min(max(busy_s / raw, 1e-3), 1e3)
        rep.ratio = ratio if rep.batches == 0 else rep.ratio + self.correction_alpha * (
            ratio - rep.ratio)
        rep.batches += 1
        self._rescale()

    def _rescale(self) -> None:
        seen = [r.ratio for r in self._replicas.values() if r.batches]
        g = math.exp(sum(math.log(x) for x in seen) / len(seen)) if seen else 1.0
        b = self.correction_bound
        self.common_scale = g
        for rep in self._replicas.values():  # an unmeasured replica gets the common part
            rep.scale = g * (min(max(rep.ratio / g, 1.0 / b), b) if rep.batches else 1.0)

    def on_episode_end(self, episode_id: str) -> None:
        self._home.pop(episode_id, None)

    def on_failed(self, replica_id: str) -> list[str]:
        """Mark a replica failed; returns the request ids that were outstanding on it (the caller
        re-issues them: routing them again places them on a healthy replica as failovers)."""
        rep = self._replicas[replica_id]
        rep.failed = True
        lost = list(rep.outstanding)
        for r in lost:
            self._where.pop(r, None)
            self._raw.pop(r, None)
        rep.outstanding.clear()
        rep.running.clear()
        return lost

    def on_recovered(self, replica_id: str) -> None:
        self._replicas[replica_id].failed = False

    # ---------------------------------------------------------------- policy

    def _finish_s(self, req: RouteRequest, replica_id: str) -> float:
        """affinity's cost of placing `req` on the replica: when it would finish (wait + its
        service) plus the delay its service inflicts on the queued rows it would share a batch
        with (they all finish when the batch does)."""
        rep = self._replicas[replica_id]
        sharing = len(self._queued(rep)) % self.cost.decode_batch
        return self.wait_s(replica_id) + (1 + sharing) * self.service_s(req, replica_id)

    def _pick(self, req: RouteRequest, cands: list[str]) -> str:
        if self.policy == "affinity":
            return min(cands, key=lambda i: self._finish_s(req, i))
        if self.policy == "least_loaded":
            return min(cands, key=lambda i: len(self._replicas[i].outstanding))
        # round robin: advance the rotation to the next candidate
        n = len(self._order)
        for _ in range(n):
            rid = self._order[self._rr % n]
            self._rr += 1
            if rid in cands:
                return rid
        return cands[0]

    def metrics(self) -> dict[str, float]:
        """`router/...` counters: decisions by reason, requests per replica, current waits."""
        out = {f"router/{k}": v for k, v in self._counts.items()}
        for rid, rep in self._replicas.items():
            out[f"router/routed/{rid}"] = self._routed[rid]
            out[f"router/wait_s/{rid}"] = self.wait_s(rid)
            out[f"router/failed/{rid}"] = float(rep.failed)
            out[f"router/scale/{rid}"] = rep.scale
            out[f"router/measured_ratio/{rid}"] = rep.ratio
        out["router/correction/common"] = self.common_scale
        out["router/correction/bound"] = self.correction_bound
        return out
