"""Router: picks the engine replica for each generation request. Pure: events in, decisions out.

Cost model: rollart.routing.cost (formulas there). A replica's wait is its outstanding requests'
batched cost in arrival order; a request's service time is what it adds to that (both kept per
replica between decisions: QueueCost).

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
the measurements say. Replicas of one class only: b = 2. (Why bounded: cost.py's
default_correction_bound.)

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

import math
from dataclasses import dataclass, field
from typing import Literal

from rollart.routing.catalog import HardwareClass
from rollart.routing.cost import CostModel, QueueCost, QueueWindows, default_correction_bound

Policy = Literal["affinity", "round_robin", "least_loaded"]
POLICIES: tuple[str, ...] = ("affinity", "round_robin", "least_loaded")


class NoHealthyReplica(RuntimeError):
    """Every replica is marked failed."""


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str
    hw: HardwareClass


# RouteRequest, Decision: one of each per turn, so slotted, not frozen (a frozen dataclass sets
# each field through object.__setattr__: ~5x the construction time). Never changed once made.
@dataclass(slots=True)
class RouteRequest:
    request_id: str
    episode_id: str
    task: str
    new_tokens: int  # prompt tokens added since the episode's previous turn (all of turn 1)
    context_tokens: int = 0  # prompt tokens before those (the episode's cacheable prefix)
    decode_tokens: float = 0.0  # expected tokens to generate (TaskProfiles.expected_decode_tokens)


@dataclass(slots=True)
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
    queue: QueueWindows  # the outstanding requests not running, with their batch windows' costs
    failed: bool = False
    # request id -> (prefill tokens, decode tokens), in arrival order
    outstanding: dict[str, tuple[float, float]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)  # outstanding ids already in an engine batch
    ratio: float = 1.0  # EMA of measured / estimated batch time (unbounded)
    log_ratio: float = 0.0
    scale: float = 1.0  # the correction applied: common part x bounded relative part
    batches: int = 0
    # batch cost of the queued / running requests (raw); None: rebuild on the next query
    queued_cost: QueueCost | None = None
    running_cost: QueueCost | None = None
    flops: float = 0.0  # the class's FLOP/s and decode step time per token (set by the Router)
    step_s: float = 0.0

    def touched(self) -> None:
        self.queued_cost = self.running_cost = None


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
        self._healthy: list[str] | None = None  # healthy replica ids, None: recompute
        self._idle = QueueCost.of(cost, replicas[0].hw, ())  # no running requests
        self._raw: dict[str, tuple[float, float]] = {}  # outstanding id -> tokens (on_batch)
        self._replicas: dict[str, _Replica] = {
            r.replica_id: _Replica(r, QueueWindows(cost, r.hw), flops=r.hw.flops,
                                   step_s=cost.decode_batch * cost.bytes_per_token
                                   / r.hw.bandwidth) for r in replicas}
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
        return list(self._healthy_ids())

    def _healthy_ids(self) -> list[str]:  # cached between failures and recoveries: do not mutate
        if self._healthy is None:
            self._healthy = [i for i in self._order if not self._replicas[i].failed]
        return self._healthy

    def wait_s(self, replica_id: str) -> float:
        rep = self._replicas[replica_id]
        return rep.scale * (self._running_cost(rep).total_s + self._queued_cost(rep).total_s)

    @staticmethod
    def _queued(rep: _Replica) -> list[tuple[float, float]]:
        if not rep.running:  # callers that never report `on_started`
            return list(rep.outstanding.values())
        return [v for k, v in rep.outstanding.items() if k not in rep.running]

    def _queued_cost(self, rep: _Replica) -> QueueCost:
        if rep.queued_cost is None:  # QueueCost.of(..., self._queued(rep)), reusing windows
            rep.queued_cost = rep.queue.cost()
        return rep.queued_cost

    def _running_cost(self, rep: _Replica) -> QueueCost:
        if rep.running_cost is None:
            rep.running_cost = QueueCost.of(self.cost, rep.spec.hw, [
                v for k, v in rep.outstanding.items() if k in rep.running]) if rep.running \
                else self._idle
        return rep.running_cost

    def home(self, episode_id: str) -> str | None:
        return self._home.get(episode_id)

    def service_s(self, req: RouteRequest, replica_id: str) -> float:
        """Estimated service time of `req` on `replica_id` (a cache hit only on the episode's
        home replica, and only when the engines cache prefixes)."""
        return self._price(req, [replica_id])[1][0]

    def _tokens(self, req: RouteRequest, replica_id: str) -> tuple[float, float]:
        hit = self.prefix_cache and self._home.get(req.episode_id) == replica_id
        return req.new_tokens + (0 if hit else req.context_tokens), req.decode_tokens

    # ---------------------------------------------------------------- events

    def route(self, req: RouteRequest) -> Decision:
        if req.request_id in self._where:
            raise ValueError(f"request {req.request_id!r} is already routed")
        healthy = self._healthy_ids()
        if not healthy:
            raise NoHealthyReplica("every engine replica is marked failed")
        home = self._home.get(req.episode_id)
        reason: Literal["new", "sticky", "spill", "failover"]
        priced = None  # affinity: every healthy replica's (finish, service, wait) for `req`
        if home is None:
            reason, (choice, priced) = "new", self._pick(req, healthy)
        elif self._replicas[home].failed:
            reason, (choice, priced) = "failover", self._pick(req, healthy)
        elif not self.sticky:
            choice, priced = self._pick(req, healthy)
            reason = "sticky" if choice == home else "spill"
        elif self.policy == "affinity":
            # cost-aware stickiness: the home's cached prefix is in its service estimate, so
            # stay unless another replica finishes this turn more than the threshold sooner.
            best, priced = self._pick(req, healthy)
            finish = priced[0]  # the same _finish_s values, in `healthy` order
            gain = finish[healthy.index(home)] - finish[healthy.index(best)]
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
                choice = self._pick(req, cands)[0]  # not affinity: nothing priced
                reason = "sticky" if choice == home else "spill"
        rep = self._replicas[choice]
        if priced is None:  # the other policies: price the choice alone
            i, priced = 0, self._price(req, [choice])
        else:  # affinity priced every healthy replica
            i = healthy.index(choice)
        est, wait = priced[1][i], priced[2][i]
        item = self._tokens(req, choice)
        if rep.queued_cost is not None:  # the request joins the end of the queue
            rep.queued_cost = rep.queued_cost.appended(self.cost, rep.spec.hw, item)
        rep.outstanding[req.request_id] = item
        rep.queue.append(req.request_id, item)
        self._raw[req.request_id] = item
        self._where[req.request_id] = choice
        self._home[req.episode_id] = choice
        self._counts[reason] += 1
        self._routed[choice] += 1
        return Decision(req.request_id, choice, self._index[choice], rep.spec.hw.name, reason,
                        est, wait)

    def on_started(self, replica_id: str, request_ids: list[str]) -> None:
        """An engine batch with `request_ids` started on `replica_id` (optional: without it every
        outstanding request counts as queued, and a new one may be estimated to join a batch
        that is already running)."""
        rep = self._replicas[replica_id]
        for r in request_ids:
            if r in rep.outstanding and r not in rep.running:
                rep.running.add(r)
                rep.queue.remove(r)
        rep.touched()

    def on_finished(self, request_id: str) -> None:
        """The completion is back (or the request was aborted): its work leaves the queue."""
        rid = self._where.pop(request_id, None)
        self._raw.pop(request_id, None)
        if rid is not None:  # only the cost of the list it leaves changes
            rep = self._replicas[rid]
            del rep.outstanding[request_id]
            if request_id in rep.running:
                rep.running.remove(request_id)
                rep.running_cost = None
            else:
                rep.queue.remove(request_id)
                rep.queued_cost = None

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
        rep.log_ratio = math.log(rep.ratio)
        self._rescale()

    def _rescale(self) -> None:
        seen = [r.log_ratio for r in self._replicas.values() if r.batches]
        g = math.exp(sum(seen) / len(seen)) if seen else 1.0
        b = self.correction_bound
        lo = 1.0 / b
        self.common_scale = g
        for rep in self._replicas.values():  # an unmeasured replica gets the common part
            x = rep.ratio / g if rep.batches else 1.0  # 1.0: b >= 1 >= lo, so g * 1.0
            x = lo if lo > x else x  # min(max(x, lo), b) as comparisons: the same, faster
            rep.scale = g * (b if b < x else x)

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
        rep.queue.clear()
        rep.touched()
        self._healthy = None
        return lost

    def on_recovered(self, replica_id: str) -> None:
        self._replicas[replica_id].failed = False
        self._healthy = None

    # ---------------------------------------------------------------- policy

    def _finish_s(self, req: RouteRequest, replica_id: str) -> float:
        return self._price(req, [replica_id])[0][0]

    def _price(self, req: RouteRequest, cands: list[str]
               ) -> tuple[list[float], list[float], list[float]]:
        """(_finish_s, service_s, wait_s) of `req` on each candidate. `_finish_s` is affinity's
        cost of placing `req` on a replica: when it would finish (wait + its service) plus the
        delay its service inflicts on the queued rows it would share a batch with (they all
        finish when the batch does). This runs for every candidate of every decision, so it is
        wait_s + (1 + sharing) x service_s written out over the cached queue costs (the same
        operations as CostModel.batch_s; tests compare it with the plain sums)."""
        cost = self.cost
        ts, fpt, b = cost.time_scale, cost.flops_per_token, cost.decode_batch
        home = self._home.get(req.episode_id) if self.prefix_cache else None
        new, ctx, d = req.new_tokens, req.context_tokens, req.decode_tokens
        finish, service, wait = [], [], []
        for rid in cands:
            rep = self._replicas[rid]
            queued = rep.queued_cost or self._queued_cost(rep)
            running = rep.running_cost or self._running_cost(rep)
            prefill = queued.tail_prefill + (new + (0 if home == rid else ctx))
            decode = d if not queued.tail or d > queued.tail_decode else queued.tail_decode
            with_item = ts * (queued.full_raw + (prefill * fpt / rep.flops + decode * rep.step_s))
            w = rep.scale * (running.total_s + queued.total_s)
            s = rep.scale * (with_item - queued.total_s)
            finish.append(w + (1 + queued.count % b) * s)
            service.append(s)
            wait.append(w)
        return finish, service, wait

    def _pick(self, req: RouteRequest, cands: list[str]
              ) -> tuple[str, tuple[list[float], list[float], list[float]] | None]:
        """The chosen candidate, and affinity's prices of all of them (None for the others)."""
        if self.policy == "affinity":
            priced = self._price(req, cands)
            best, best_s = cands[0], math.inf
            for rid, f in zip(cands, priced[0], strict=True):  # the first of the cheapest
                if f < best_s:
                    best, best_s = rid, f
            return best, priced
        if self.policy == "least_loaded":
            return min(cands, key=lambda i: len(self._replicas[i].outstanding)), None
        # round robin: advance the rotation to the next candidate
        n = len(self._order)
        for _ in range(n):
            rid = self._order[self._rr % n]
            self._rr += 1
            if rid in cands:
                return rid, None
        return cands[0], None

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
