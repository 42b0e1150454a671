"""The trainer's side of a weight sync to engines on other hosts: straight from the trainer's
process (rank 0) into a chain of engines (`rollart/engines/weight_stream.py`), never through the
flow process.

A sharded trainer holds no full copy: the weights go out one bucket (~64 MB) at a time, each
bucket's full tensors gathered from every rank's shards as the sender asks for it. Every rank
makes the same gathers in the same order (each is a collective); rank 0 alone sends. If the
stream fails part-way, rank 0 still makes the remaining gathers before it raises, so the other
ranks are not left waiting in a collective. A tied weight is sent once; the engine reties it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from rollart.engines.weight_stream import BUCKET_BYTES, TensorMeta, plan_buckets, send_weights
from rollart.train.distributed import full

if TYPE_CHECKING:
    from rollart.train.trainer import Trainer


def _unique(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A tied tensor (one parameter under two names) under its first name only."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v
    return out


def stream_weights(trainer: Trainer, chain: list[tuple[str, int]], token: bytes,
                   timeout_s: float, bucket_bytes: int = BUCKET_BYTES) -> dict[str, Any]:
    """Send the trainer's current weights along `chain` (every rank calls this)."""
    state = _unique(trainer.model.state_dict())  # [global shapes]; DTensors when sharded
    metas = [TensorMeta(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    version = trainer.version
    if not trainer.ranks.sharded:
        return send_weights(chain, token, version, state, timeout_s=timeout_s,
                            bucket_bytes=bucket_bytes)
    buckets = plan_buckets(metas, bucket_bytes)
    gathered = 0

    def gather(bucket: list[TensorMeta]) -> list[Tensor]:
        nonlocal gathered
        gathered += 1
        return [full(state[m.name]).detach() for m in bucket]

    if trainer.ranks.rank != 0:
        for bucket in buckets:
            gather(bucket)
        return {"version": version, "rank": trainer.ranks.rank}
    try:
        return send_weights(chain, token, version, gather, meta=metas, timeout_s=timeout_s,
                            bucket_bytes=bucket_bytes)
    finally:  # a failed stream: the others' collectives still need rank 0
        for bucket in buckets[gathered:]:
            gather(bucket)
