"""`TrainerGroup`: the driver's side of N trainer ranks (`train.world_size` > 1).

It has the `TrainerService` interface, so the driver, the stages and recovery use one rank or a
group alike. A method that touches the model (update, weights, checkpoints, fingerprint) is a
collective: it is called on every rank at once, and rank 0's answer is the group's (every rank
computes the same metrics; rank 0 owns the files). Bookkeeping that every rank keeps alike (the
pending samples restored from a checkpoint, the ledger) is asked of rank 0 alone. A rank that
fails or is lost fails the call (the others fail in their collective once
`train.dist_timeout_s` passes), and the run restarts its services from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from rollart.handles import Deadline, call
from rollart.service_protocols import (
    Dropped,
    SharedWeights,
    TrainerAPI,
    WeightsPublished,
    WeightsStreamedOut,
)
from rollart.types import Trajectory

R = TypeVar("R")


class TrainerGroup:
    def __init__(self, ranks: list[TrainerAPI]) -> None:
        if not ranks:
            raise ValueError("a trainer group needs at least one rank")
        self.ranks = ranks

    def map_handles(self, fn: Callable[[Any], Any]) -> TrainerGroup:
        """The same ranks, each handle mapped by `fn` (rollart.handles detach/attach/release)."""
        return TrainerGroup([fn(r) for r in self.ranks])

    # ---- fan-out -----------------------------------------------------------------------------
    def _all(self, method: Callable[[TrainerAPI], R], timeout: Deadline = "default") -> R:
        """`method(call(rank))` on every rank at once, e.g. `lambda r: r.update(...)`; rank 0's
        result. The first failure is raised as soon as it happens (the other ranks' calls end
        in their collective's timeout)."""
        pool = ThreadPoolExecutor(len(self.ranks), thread_name_prefix="trainer-rank")
        futures = [pool.submit(method, call(r, timeout=timeout, while_alive=True))
                   for r in self.ranks]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and (err := f.exception()) is not None:
                    raise err
            return futures[0].result()
        finally:
            pool.shutdown(wait=False)

    def _first(self) -> TrainerAPI:
        """Rank 0, to be asked alone: `self._first().method(...)`."""
        return call(self.ranks[0])

    # ---- TrainerService's interface ----------------------------------------------------------
    def update(self, trajs: list[Trajectory], dropped: Dropped | None = None,
               step: int | None = None) -> dict[str, Any]:
        return self._all(lambda r: r.update(trajs, dropped, step))

    def export_weights(self) -> tuple[int, dict[str, Any]]:
        return self._all(lambda r: r.export_weights())

    def stream_weights(self, chain: list[tuple[str, int]], token: bytes,
                       timeout_s: float) -> WeightsStreamedOut:
        return self._all(lambda r: r.stream_weights(chain, token, timeout_s))

    def weight_version(self) -> int:
        return self._first().weight_version()

    def share_weights(self) -> SharedWeights:
        raise RuntimeError("a sharded trainer holds no full copy to share; it exports instead")

    def shared_memory_sync(self) -> bool:
        return self._first().shared_memory_sync()

    def sync_via_store(self) -> bool:
        return self._first().sync_via_store()

    def publish_weights(self) -> WeightsPublished:
        return self._all(lambda r: r.publish_weights())

    def save_checkpoint(self, step: int, meta: dict[str, Any],
                        engine_rng: list[bytes] | None = None,
                        pending: list[Trajectory] | None = None,
                        rollout_state: bytes | None = None) -> dict[str, Any]:
        out = self._all(lambda r: r.save_checkpoint(step, meta, engine_rng, pending,
                                                    rollout_state))
        return {**out, "world_size": len(self.ranks)}

    def flush_checkpoints(self, timeout: float | None = None) -> list[dict[str, Any]]:
        return self._all(lambda r: r.flush_checkpoints(timeout), timeout=None)

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        return self._all(lambda r: r.load_checkpoint(step))

    def take_pending(self) -> list[Trajectory]:
        return self._all(lambda r: r.take_pending())  # every rank hands its copy out once

    def take_rollout_state(self) -> tuple[bytes | None, list[Trajectory]]:
        return self._all(lambda r: r.take_rollout_state())

    def ledger_records(self) -> list[list[Any]]:
        return self._first().ledger_records()

    def fingerprint(self) -> float:
        return self._all(lambda r: r.fingerprint())

    def where(self) -> dict[str, Any]:
        """Rank 0's worker identity, and every rank's address (a lost rank fails this)."""
        with ThreadPoolExecutor(len(self.ranks), thread_name_prefix="trainer-rank") as pool:
            places = list(pool.map(lambda r: call(r).where(), self.ranks))
        return {**places[0], "ranks": [p.get("address") for p in places]}

    def close(self) -> None:
        self._all(lambda r: r.close())
