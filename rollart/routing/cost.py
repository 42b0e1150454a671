"""The router's cost model, its correction bound, and a replica queue's cost kept between
routing decisions.

`CostModel` prices requests on a hardware class (see rollart.routing.router for the formulas).
`QueueCost` is `CostModel.batch_s` of one replica's queue, split so that the cost of appending one
more request is O(decode_batch) instead of O(queue): the sum over the queue's complete batches
(accumulated in the same order as `batch_s` does) and its last, incomplete batch. The Router asks
for every candidate replica's wait and marginal cost on every decision; recomputing `batch_s`
over each queue made a decision O(replicas x queue), which dominated the simulator at 1,000+
replicas. The numbers are the same floating-point operations in the same order as `batch_s`, so
cached and uncached routers take identical decisions (tests/unit/test_routing.py checks both).
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
    smallest class advantage. H800 + H20: (4000 / 3350) ** 0.25 = 1.0453."""
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
        return QueueCost.of(self, hw, list(items)).total_s


@dataclass(frozen=True)
class QueueCost:
    """`CostModel.batch_s` of a queue (`total_s`), kept as the raw sum over its complete batches
    (`full_raw`, before time_scale) and its incomplete last batch (`tail`: its rows, their prompt
    tokens summed left to right and their longest decode)."""

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
