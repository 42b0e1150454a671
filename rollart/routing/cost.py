"""The router's cost model, its correction bound, and a replica queue's cost kept between
routing decisions.

`CostModel` prices a request on hardware class c:

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

A replica's wait (rollart.routing.router) is batch_s summed over its outstanding requests cut
into batches in arrival order, and a request's service time on a replica is what it adds to that
(its marginal cost). For a full batch of equal rows this is the per-request sum above; a
decode-heavy request that joins a batch of short ones costs the whole batch its long decode
(issue 21: without this the router put decode-heavy turns next to prefill-heavy ones on the
compute pool, where every such batch ran 128 weight-bound steps instead of 8, and affinity lost
to round robin).

`QueueCost` is `CostModel.batch_s` of one replica's queue, split so that the cost of appending one
more request is O(decode_batch) instead of O(queue): the sum over the queue's complete batches
(accumulated in the same order as `batch_s` does) and its last, incomplete batch. The Router asks
for every candidate replica's wait and marginal cost on every decision; recomputing `batch_s`
over each queue made a decision O(replicas x queue), which dominated the simulator at 1,000+
replicas. The numbers are the same floating-point operations in the same order as `batch_s`, so
cached and uncached routers take identical decisions (tests/unit/test_routing.py checks both).

`QueueWindows` keeps each complete batch window's cost between rebuilds: a completion shifts
every batch boundary behind it, so nothing in a QueueCost survives it, and rebuilding one with
QueueCost.of after every completion (8 replicas x ~200 outstanding requests) was ~13% of the
rollout service's event loop; most of the windows a rebuild needs were priced by an earlier one.
Pure: no clocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollart.routing.catalog import HardwareClass

Item = tuple[float, float]  # (prefill tokens, decode tokens)

SAME_CLASS_BOUND = 2.0  # correction bound when every replica has the same figures


def default_correction_bound(classes: Iterable[HardwareClass]) -> float:
    """(smallest ratio > 1 between two replicas' FLOP/s or bandwidths) ** (1/4): the relative
    correction between two replicas (at most bound^2) then stays below the square root of the
    smallest class advantage. H800 + H20: (4000 / 3350) ** 0.25 = 1.0453.

    Why the router's correction must be bounded (issue 21): with one unbounded scalar per
    replica, the measured batch times of two emulated replicas sharing a CPU host carried the
    *other* replica's load (both competed for the same cores and the GIL, and the old emulation
    multiplied the stretched compute time by its slowdown), so the scales (4.1-6.5 between
    repeats) tracked contention, not hardware. A ratio of two such scales beyond 1.19 (the H20's
    whole decode advantage) flips decode-heavy turns to the H800; beyond ~4 it flips prefill-
    heavy ones too; and a replica that had not reported yet kept scale 1, so it looked several
    times faster than the measured ones. Placements then followed the noise (in one repeat the
    decision counts equalled round robin's)."""
    ratios = [max(x, y) / min(x, y)
              for a, c in itertools.combinations(list(classes), 2)
              for x, y in ((a.flops, c.flops), (a.bandwidth, c.bandwidth)) if x != y]
    return min(ratios) ** 0.25 if ratios else SAME_CLASS_BOUND


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

    def chunk_s(self, hw: HardwareClass, chunk: Sequence[Item]) -> float:
        """One engine batch (at most `decode_batch` rows), before time_scale: its prefill plus its
        longest decode at a full step per token."""
        prefill, decode = 0.0, max(d for _, d in chunk)
        for p, _ in chunk:  # summed left to right, as QueueCost extends a batch row by row
            prefill += p
        return self.rows_s(hw, prefill, decode)

    def rows_s(self, hw: HardwareClass, prefill: float, decode: float) -> float:
        """A batch with `prefill` prompt tokens in all and `decode` as its longest answer."""
        return (prefill * self.flops_per_token / hw.flops
                + decode * (self.decode_batch * self.bytes_per_token / hw.bandwidth))

    def batch_s(self, hw: HardwareClass, items: Iterable[Item]) -> float:
        """(prefill tokens, decode tokens) of requests served in this order, `decode_batch` rows
        per batch: each batch's prefill plus its longest decode at a full step per token."""
        b, full, prefill, decode, k = self.decode_batch, 0.0, 0.0, 0.0, 0
        for p, d in items:  # QueueCost.of's loop without building one (on_batch: hot)
            prefill += p
            if k == 0 or d > decode:
                decode = d
            k += 1
            if k == b:
                full += self.rows_s(hw, prefill, decode)
                prefill, decode, k = 0.0, 0.0, 0
        return self.time_scale * (full + self.rows_s(hw, prefill, decode) if k else full)


@dataclass(slots=True)
class QueueCost:
    """`CostModel.batch_s` of a queue (`total_s`), kept as the raw sum over its complete batches
    (`full_raw`, before time_scale) and its incomplete last batch (`tail`: its rows, their prompt
    tokens summed left to right and their longest decode). Never changed once made (a new one
    per change); not frozen: two are built per routed turn, and a frozen dataclass's
    construction (each field through object.__setattr__) cost ~5x a slotted one's."""

    total_s: float
    full_raw: float
    tail: tuple[Item, ...]
    tail_prefill: float
    tail_decode: float
    count: int

    @classmethod
    def of(cls, cost: CostModel, hw: HardwareClass, items: Sequence[Item]) -> QueueCost:
        """Built in one pass with the same float operations, in the same order, as appending
        the items one by one (equal to the last bit: tests/unit/test_routing_cache.py). The
        router rebuilds a replica's queue after every engine call on it, so this is hot."""
        b, rows_s = cost.decode_batch, cost.rows_s
        full, prefill, decode, k = 0.0, 0.0, 0.0, 0
        for p, d in items:
            prefill += p
            if k == 0 or d > decode:
                decode = d
            k += 1
            if k == b:
                full += rows_s(hw, prefill, decode)
                prefill, decode, k = 0.0, 0.0, 0
        if k == 0:
            return cls(cost.time_scale * full, full, (), 0.0, 0.0, len(items))
        raw = full + rows_s(hw, prefill, decode)
        return cls(cost.time_scale * raw, full, tuple(items[len(items) - k:]), prefill, decode,
                   len(items))

    def with_item_s(self, cost: CostModel, hw: HardwareClass, item: Item) -> float:
        """batch_s of this queue with `item` appended."""
        p, d = item
        return cost.time_scale * (self.full_raw + cost.rows_s(
            hw, self.tail_prefill + p, d if not self.tail or d > self.tail_decode
            else self.tail_decode))

    def appended(self, cost: CostModel, hw: HardwareClass, item: Item) -> QueueCost:
        p, d = item
        tail = (*self.tail, item)
        prefill = self.tail_prefill + p
        decode = d if not self.tail or d > self.tail_decode else self.tail_decode
        if len(tail) == cost.decode_batch:
            full = self.full_raw + cost.rows_s(hw, prefill, decode)
            return QueueCost(cost.time_scale * full, full, (), 0.0, 0.0, self.count + 1)
        raw = self.full_raw + cost.rows_s(hw, prefill, decode)
        return QueueCost(cost.time_scale * raw, self.full_raw, tail, prefill, decode,
                         self.count + 1)


class QueueWindows:
    """A replica's queued (not running) requests in arrival order, with the cost of every batch
    window seen so far kept beside its first request. A completion shifts every batch boundary
    behind it, so QueueCost.of redid every batch; but completions leave near the head and new
    requests join at the tail, so the windows that a rebuild needs (8 rows from each batch's
    first request) were mostly priced by an earlier rebuild and are still intact (a removal
    drops only the windows that held the removed row). `cost` equals QueueCost.of over the same
    items to the last bit (each window priced by the same loop, the windows summed left to
    right: tests/unit/test_routing_cache.py).

    The window costs are a list in step with the requests (`priced[i]`: the window from row i,
    None until priced), not a dict keyed by request id: a rebuild then reads its windows with
    one slice instead of a lookup per window, each touching a request id's string object (in
    py-spy profiles of the rollout service's loop at 8,192 episodes, `cost` ~9 % of its samples
    before, ~5 % after)."""

    __slots__ = ("ids", "items", "priced", "batch", "cost_model", "hw")

    def __init__(self, cost: CostModel, hw: HardwareClass) -> None:
        self.ids: list[str] = []
        self.items: list[Item] = []
        self.priced: list[float | None] = []  # raw cost of the batch window from row i, or None
        self.batch, self.cost_model, self.hw = cost.decode_batch, cost, hw

    def __len__(self) -> int:
        return len(self.ids)

    def append(self, rid: str, item: Item) -> None:
        self.ids.append(rid)
        self.items.append(item)
        self.priced.append(None)

    def remove(self, rid: str) -> None:
        i = self.ids.index(rid)  # near the head: engines finish the oldest requests first
        priced = self.priced
        del self.ids[i], self.items[i], priced[i]  # with the window from row i
        for k in range(max(0, i - self.batch + 1), i):  # the windows before it that held it
            priced[k] = None

    def clear(self) -> None:
        self.ids.clear()
        self.items.clear()
        self.priced.clear()

    def cost(self) -> QueueCost:
        """QueueCost.of(cost, hw, items), reusing the windows priced before."""
        cost, hw, b, items, priced = self.cost_model, self.hw, self.batch, self.items, self.priced
        n = len(items)
        m = n - n % b
        costs = priced[0:m:b]
        if None in costs:  # price the new windows with QueueCost.of's loop over one batch
            for j, c in enumerate(costs):
                if c is None:
                    prefill, decode = 0.0, items[j * b][1]
                    for p, d in items[j * b:(j + 1) * b]:
                        prefill += p
                        if d > decode:
                            decode = d
                    costs[j] = priced[j * b] = cost.rows_s(hw, prefill, decode)
        full = 0.0
        for c in costs:  # left to right, as QueueCost.of (not sum(): compensated from 3.12)
            full += c  # type: ignore[operator]  # every window priced above
        if m == n:
            return QueueCost(cost.time_scale * full, full, (), 0.0, 0.0, n)
        tail = tuple(items[m:])
        prefill, decode = 0.0, tail[0][1]
        for p, d in tail:
            prefill += p
            if d > decode:
                decode = d
        raw = full + cost.rows_s(hw, prefill, decode)
        return QueueCost(cost.time_scale * raw, full, tail, prefill, decode, n)
