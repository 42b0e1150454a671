"""`TrainerService`: model, optimizer (and reference) on the trainer-class worker, alive for the
run; also the owner of the sample ledger and the checkpoints (`rollart/storage/checkpointing.py`).

With `train.world_size` N > 1 there are N of them, rank r on its own trainer-class worker, in one
torch.distributed group (`rollart/train/distributed.py`); the driver reaches them through a
`TrainerGroup` (`rollart/services/trainer_group.py`), which calls every rank alike and answers
with rank 0's result. Every rank keeps the same ledger (same inputs); rank 0 writes it.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, cast

from rollart.cpu_pinning import pin_to_class
from rollart.handles import set_call_timeout, worker_identity
from rollart.models.run_model import build_model, param_checksum
from rollart.run import RunSpec
from rollart.service_protocols import SharedWeights, WeightsPublished, WeightsStreamedOut
from rollart.types import Trajectory

if TYPE_CHECKING:  # torch and the trainer load in the worker that builds one (__init__)
    import torch

    from rollart.engines.shared_weights import SharedWeightsWriter


class UpdateOutOfOrder(RuntimeError):
    """An update whose step is not the trainer's next one (applying it would count a batch
    twice, or skip one)."""


class TrainerService:
    """The policy update and everything that must stay consistent with it."""

    def __init__(self, run: RunSpec, rank: int = 0, world: int = 1,
                 meet: tuple[str, int] | None = None) -> None:
        """`rank` of `world` trainer ranks, meeting at `meet` (rank 0's host and a free port
        there) when world > 1."""
        import torch

        from rollart.action_grammar import token_texts
        from rollart.storage.checkpointing import Checkpointer
        from rollart.train.distributed import Ranks, init_group
        from rollart.train.sharded_state import load_pretrained
        from rollart.train.trainer import Trainer

        self.cfg = cfg = run.cfg
        set_call_timeout(cfg.cluster.call_timeout_s)  # calls made from this worker
        pin_to_class(cfg.cluster.cpu_cores, cfg.cluster.stages["trainer"])
        torch.set_num_threads(cfg.train.threads)
        self.ranks = Ranks(rank, world)
        if self.ranks.sharded:
            if meet is None:
                raise ValueError("a trainer rank of a group needs the group's meeting point")
            init_group(self.ranks, meet[0], meet[1], cfg.train.dist_timeout_s)
        torch.manual_seed(cfg.seed)
        self.store = run.store()
        # Sharded, a local model is read rank by rank: no rank holds it whole.
        skeleton = self.ranks.sharded and cfg.model.source == "hf_dir"
        model, tok = build_model(run, skeleton=skeleton)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.trainer = Trainer(model, cfg.algo, cfg.train,
                               temperature=cfg.engine.temperature, pad_id=int(pad),
                               ranks=self.ranks,
                               mixed_precision=cfg.train.mixed_precision == "bf16",
                               token_texts=token_texts(tok))  # token grammars' masks
        if skeleton:
            load_pretrained(self.trainer, str(cfg.model.path))
        # Ledger, checkpoint snapshots and background uploads (rollart/storage/checkpointing.py)
        self.ckpt = Checkpointer(cfg, self.store)
        self.identity = worker_identity()
        self._shared: SharedWeightsWriter | None = None  # /dev/shm file, made on first sync
        self._run_id = run.run_id

    def update(self, trajs: list[Trajectory],
               dropped: list[tuple[str, int, str]] | None = None,
               step: int | None = None) -> dict[str, Any]:
        """One policy update; then every sample's fate goes into the ledger (consumed by this
        step, or dropped with a reason, incl. `dropped` from earlier stages). `step`: the
        update this is (iteration + 1); anything but the trainer's next step is refused, so a
        batch is never applied twice (Dask re-runs a finished stage task whose result was on a
        worker that died while the task was still referenced)."""
        if step is not None and step != self.trainer.step + 1:
            raise UpdateOutOfOrder(
                f"update for step {step} reached a trainer at step {self.trainer.step} "
                f"(expected step {self.trainer.step + 1}): a re-run or lost update; refused")
        import torch

        torch.set_num_threads(self.cfg.train.threads)
        metrics = self.trainer.update(trajs)
        metrics["train/samples_consumed"] = float(self.ckpt.record_update(
            trajs, dropped, self.trainer.step, skipped="train/skipped" in metrics))
        every = self.cfg.storage.weights_every
        if every and not self.cfg.storage.sync_via_store and self.trainer.version % every == 0:
            metrics["perf/weights_publish_wait_s"] = self.ckpt.publish_async(self.trainer)
        return {"metrics": metrics, "version": self.trainer.version, **self.identity}

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.trainer.version, self.trainer.export_weights()

    def stream_weights(self, chain: list[tuple[str, int]], token: bytes,
                       timeout_s: float) -> WeightsStreamedOut:
        """The current weights straight to the engines listening at `chain` (a pipeline:
        each forwards to the next); every rank gathers, rank 0 sends (rollart/train/
        stream_out.py)."""
        from rollart.train.stream_out import stream_weights

        sent = stream_weights(self.trainer, [(a[0], a[1]) for a in chain], token, timeout_s)
        return cast(WeightsStreamedOut, {**sent, "version": self.trainer.version})

    def weight_version(self) -> int:
        return self.trainer.version

    def rank(self) -> int:
        return self.ranks.rank

    def close(self) -> None:
        """Leave the trainer group (the run's end, or before its services are rebuilt)."""
        from rollart.train.distributed import destroy_group

        if self.ranks.sharded:
            destroy_group()

    def share_weights(self) -> SharedWeights:
        """Copy the current weights into this trainer's shared-memory file; returns the small
        descriptor engines on this host map (rollart/engines/shared_weights.py)."""
        from rollart.engines.shared_weights import SharedWeightsWriter, shm_dir

        if self._shared is None:
            path = shm_dir() / f"rollart-{self._run_id}-{os.getpid()}.weights"
            self._shared = SharedWeightsWriter(path)
            weakref.finalize(self, self._shared.close)  # the file holds RAM until removed
            # The parameters move into the file: publishing then copies nothing.
            self._shared.adopt(self.trainer.model)
        desc = self._shared.publish(self.trainer.version, self.trainer.model.state_dict())
        return cast(SharedWeights, desc)

    def shared_memory_sync(self) -> bool:
        # A sharded trainer holds no full copy to share: it exports (or streams) instead.
        return self.cfg.engine.shared_memory_sync and not self.ranks.sharded

    def sync_via_store(self) -> bool:
        return self.cfg.storage.sync_via_store

    def publish_weights(self) -> WeightsPublished:
        """Publish the current version to `weights/v{n}/` now (store-mediated sync)."""
        # sharded: gathered, rank 0 publishes
        return cast(WeightsPublished, self.ckpt.publish_now(self.trainer))

    def save_checkpoint(self, step: int, meta: dict[str, Any],
                        engine_rng: list[bytes] | None = None,
                        pending: list[Trajectory] | None = None,
                        rollout_state: bytes | None = None) -> dict[str, Any]:
        """Snapshot now, upload in the background (`storage.background_upload`)."""
        return {**self.ckpt.save(self.trainer, step, meta, engine_rng, pending, rollout_state),
                **self.identity}

    def flush_checkpoints(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for background uploads (checkpoints, weight versions); raises a failure."""
        return self.ckpt.flush(timeout)

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        """Restore model, optimizer, RNG, step/version, sample ledger and pending samples."""
        return self.ckpt.restore(self.trainer, step)

    def take_pending(self) -> list[Trajectory]:
        """Complete-but-unconsumed samples restored from the checkpoint (handed out once)."""
        out, self.ckpt.pending = self.ckpt.pending, []
        return out

    def take_rollout_state(self) -> tuple[bytes | None, list[Trajectory]]:
        """The restored rollout service state and its pending samples (handed out once)."""
        state, self.ckpt.rollout_state = self.ckpt.rollout_state, None
        return state, self.take_pending()

    def ledger_records(self) -> list[list[Any]]:
        return [list(r) for r in self.ckpt.ledger.records]

    def fingerprint(self) -> float:
        if not self.ranks.sharded:
            return param_checksum(self.trainer.model)
        import torch

        from rollart.train.distributed import all_reduce_sum, local

        with torch.no_grad():  # sum of |w| over every rank's shards
            part = sum(local(p).detach().double().abs().sum()
                       for p in self.trainer.policy.parameters())
            return float(all_reduce_sum(torch.as_tensor(part, dtype=torch.float64), self.ranks))

    def where(self) -> dict[str, Any]:
        return self.identity
