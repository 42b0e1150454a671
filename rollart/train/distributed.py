"""Trainer ranks: one torch.distributed group over N trainer-class workers, the model sharded.

A run with `train.world_size` N > 1 holds N `TrainerService`s, rank r on its own trainer-class
worker. They meet at rank 0's worker (its host and a free port, found through the Dask scheduler
by the driver) over gloo (CPU) or nccl (CUDA), with an explicit timeout so a lost rank fails the
others' collectives instead of hanging them. The policy is sharded with FSDP2 (`fully_shard`):
one unit per decoder layer, then the root (embeddings, final norm and the tied LM head).

Every rank receives the whole batch (token ids: small) and works on its own share of the rows
(`partition_by_tokens`), so the loss normalisation (token and sequence counts), the advantages
and every metric are taken over the whole batch, as one rank would (`Trainer.update`).
"""

from __future__ import annotations

import datetime
import heapq
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger("rollart.train")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the trainer group (rank 0 of 1 when not sharded)."""

    rank: int = 0
    world: int = 1

    @property
    def sharded(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def free_port(host: str) -> int:
    """A free TCP port on `host` (asked on rank 0's worker, where the group meets)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(ranks: Ranks, host: str, port: int, timeout_s: float) -> str:
    """Join the trainer group; returns the backend. A group left by an earlier attempt in this
    process (a restarted run) is torn down first: one default group per process."""
    destroy_group()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per rank of a host (each worker may see them all)
        torch.cuda.set_device(ranks.rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=ranks.rank,
                            world_size=ranks.world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # a peer already gone: nothing left to agree with
            log.warning("trainer group teardown: %s", err)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers FSDP shards one by one (`model.model.layers` in HF causal LMs)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"train.world_size > 1 shards a model per decoder layer, but "
                         f"{type(model).__name__} has no `model.layers`: use train.world_size=1")
    return list(layers)


def shard(root: torch.nn.Module, model: torch.nn.Module, world: int,
          mixed_precision: bool = False) -> None:
    """FSDP2 over `world` ranks: each decoder layer of `model`, then `root` (which holds
    `model`; its forward is the one the trainer calls, so the root unit's parameters, the
    embeddings, the final norm and the tied head, are gathered around it). `mixed_precision`
    (CUDA): bf16 parameters in compute, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world,))
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(root, mesh=mesh, **kw)


def partition_by_tokens(lengths: list[int], world: int) -> list[list[int]]:
    """Row indices of each rank's share, balanced by tokens: longest rows first, each to the
    rank with the fewest tokens so far (ties: the lower rank). Deterministic, so every rank
    computes every share; each share is in batch order."""
    loads = [(0, r) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(loads)
        shares[r].append(i)
        heapq.heappush(loads, (load + lengths[i], r))
    return [sorted(s) for s in shares]


def plan_rows(lengths: list[int], world: int, rank: int, size: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches as row indices, `size` rows each at most. Every rank runs
    as many as the rank with the most (each forward and backward of a sharded model is a
    collective); a rank short of rows gets [] for each missing one (padding)."""
    shares = [list(range(len(lengths)))] if world == 1 else partition_by_tokens(lengths, world)
    n_micro = max(1, max(-(-len(s) // size) for s in shares))
    mine = shares[rank]
    return [mine[j * size:(j + 1) * size] for j in range(n_micro)]


def device_for(ranks: Ranks) -> torch.device:
    """Where a rank trains: its GPU when sharded over nccl, else the CPU (an unsharded trainer
    stays on the CPU, beside engines that share its weights through /dev/shm)."""
    if ranks.sharded and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm_device() -> torch.device:
    """nccl reduces CUDA tensors only; gloo CPU ones."""
    return device_for(Ranks(0, 2)) if dist.is_initialized() else torch.device("cpu")


def all_reduce_sum(t: Tensor, ranks: Ranks) -> Tensor:
    """The elementwise sum of `t` over the ranks (`t` itself when not sharded)."""
    if ranks.sharded:
        dev = _comm_device()
        moved = t.to(dev)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        if moved is not t:
            t.copy_(moved)
    return t


def full(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: every rank calls it in the same order), or `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor, or `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_gather_json(obj: object, ranks: Ranks) -> list[object]:
    """Every rank's `obj` (JSON-serialisable), in rank order: small bookkeeping (a checkpoint's
    file entries), sent as bytes in tensors (no pickle between processes)."""
    import json

    data = json.dumps(obj, sort_keys=True).encode()
    if not ranks.sharded:
        return [json.loads(data)]
    dev = _comm_device()
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(ranks.world)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.zeros(width, dtype=torch.uint8, device=dev) for _ in range(ranks.world)]
    dist.all_gather(parts, mine.to(dev))
    parts = [p.cpu() for p in parts]
    return [json.loads(bytes(p[:int(s.item())].tolist())) for p, s in zip(parts, sizes,
                                                                           strict=True)]
