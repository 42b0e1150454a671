"""What the trainer service keeps for exact resume, and how it reaches the store.

`Checkpointer` lives next to the Trainer (in TrainerService on the trainer-class worker):

- `record_update` writes every sample's fate into the ledger once the update succeeded;
- `save` snapshots, in memory and consistently, the weights (safetensors), optimizer, RNG states
  (trainer and, when given, engines), step/version, the ledger with its plan cursor, pending
  samples and the resolved config; the upload (files, manifest last, retention) then runs on a
  background thread, so the next iteration does not wait for it;
- `flush` waits for uploads (the run's end awaits the final checkpoint);
- `restore` loads a complete checkpoint back into the trainer and the ledger;
- weight versions: `publish_async` (every `storage.weights_every` versions, background) and
  `publish_now` (store-mediated sync).
"""

from __future__ import annotations

import io
import logging
import time
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from rollart.config import RunConfig, dump_config
from rollart.rollout.ids import group_of_sample
from rollart.rollout.plan import plan_iteration
from rollart.storage.background import BackgroundWriter
from rollart.storage.blob import Blob
from rollart.storage.ledger import LedgerAudit, SampleLedger
from rollart.storage.store import RunStore
from rollart.storage.weights import prune_weights, publish_weights, serialize_weights
from rollart.train.state_io import engine_rng_files
from rollart.types import Trajectory, table_to_trajectories, trajectories_to_table

if TYPE_CHECKING:
    from rollart.train.trainer import Trainer

log = logging.getLogger("rollart.storage")


def issued_ids(cfg: RunConfig, next_iteration: int) -> list[str]:
    """Every sample id the synchronous plan issued before `next_iteration`."""
    return [s.sample_id for i in range(next_iteration) for s in plan_iteration(cfg, i)]


def planned_groups(cfg: RunConfig, start: int, stop: int) -> set[str]:
    return {s.group_id for i in range(max(start, 0), stop) for s in plan_iteration(cfg, i)}


def audit_ledger(ledger: SampleLedger, cfg: RunConfig, next_iteration: int) -> LedgerAudit:
    """Synchronous plan without spares or retries: every planned sample exactly once. Otherwise
    (staleness, redundancy, re-issued members) per group: every group of the iterations that
    are settled (< next_iteration - max_staleness) has records, none is outside the groups the
    rollout service may have started, and no sample appears twice."""
    r = cfg.rollout
    audit = ledger.audit(issued_ids(cfg, next_iteration))
    exact = r.max_staleness == 0 and r.redundancy == 0
    if exact and not any(reason in ("env_error", "engine_error", "timeout", "host_lost")
                         for *_, reason in ledger.records):
        return audit
    seen = {group_of_sample(x) for x in ledger.ids()}
    settled = planned_groups(cfg, 0, next_iteration - r.max_staleness)
    allowed = planned_groups(cfg, 0, next_iteration + r.max_staleness + 1)
    audit.missing = sorted(settled - seen)
    audit.unexpected = sorted(x for x in seen if x not in allowed)
    audit.issued = len(settled)  # groups, in this mode
    return audit


class Checkpointer:
    def __init__(self, cfg: RunConfig, store: RunStore) -> None:
        self.cfg, self.store = cfg, store
        self.ledger = SampleLedger()
        self.pending: list[Trajectory] = []  # complete, unconsumed samples (restored on resume)
        self.rollout_state: bytes | None = None  # the rollout service's groups (restored)
        self.uploads = BackgroundWriter("checkpoints", max_pending=1)
        self.weight_uploads = BackgroundWriter("weights", max_pending=2)

    # ---- ledger ------------------------------------------------------------------------------
    def record_update(self, trajs: list[Trajectory], dropped: list[Any] | None, step: int,
                      skipped: bool) -> int:
        """Consumed: trajectories with model tokens (unless the update was skipped); dropped:
        the rest, plus `dropped` = [(sample_id, iteration, reason)] from earlier stages."""
        used = [] if skipped else [(t.sample_id, t.iteration) for t in trajs
                                   if t.num_model_tokens > 0]
        used_ids = {sid for sid, _ in used}
        unused = [(t.sample_id, t.iteration, "no_model_tokens" if not skipped else "skipped")
                  for t in trajs if t.sample_id not in used_ids]
        self.ledger.consume(used, step)
        self.ledger.drop([*unused, *(tuple(d) for d in dropped or [])], step)
        return len(used)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, trainer: Trainer, step: int, meta: dict[str, Any],
             engine_rng: list[bytes] | None = None,
             pending: list[Trajectory] | None = None,
             rollout_state: bytes | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        next_it = int(meta.get("next_iteration", int(meta.get("iteration", step - 1)) + 1))
        self.ledger.next_iteration = next_it
        self.pending = list(pending or [])
        self.ledger.set_pending([(t.sample_id, t.iteration) for t in self.pending], step)
        audit = audit_ledger(self.ledger, self.cfg, next_it)
        if not audit.ok:
            log.warning("sample ledger at checkpoint %d does not balance: %s", step,
                        audit.as_dict())
        if trainer.ranks.sharded:  # every rank writes its shards; rank 0 the rest, manifest last
            written = self._save_shards(trainer, step)
            if trainer.ranks.rank != 0:
                return {"path": self.store.checkpoint_dir(step), "rank": trainer.ranks.rank,
                        "save_s": time.perf_counter() - t0, "ledger": audit.as_dict()}
            files = trainer.meta_files()
        else:
            written, files = {}, trainer.checkpoint_files()
        files["ledger.json"] = self.ledger.to_json()
        files["config.yaml"] = dump_config(self.cfg).encode()
        if engine_rng:  # safetensors, never a pickle (rollart/train/state_io.py)
            files.update(engine_rng_files(list(engine_rng)))
        if rollout_state is not None:  # async runs: groups not consumed yet (rollout/snapshot.py)
            files["rollout_state.json"] = rollout_state
        if self.pending:
            buf = io.BytesIO()
            pq.write_table(trajectories_to_table(self.pending), buf)
            files["pending.parquet"] = buf.getvalue()
        meta = {**meta, "version": trainer.version, "train_step": trainer.step,
                "next_iteration": next_it, "ledger": audit.as_dict()}
        snapshot_s = time.perf_counter() - t0
        wait_s = 0.0
        # A sharded checkpoint's shards are written already: its manifest follows at once.
        background = self.cfg.storage.background_upload and not trainer.ranks.sharded
        if background:
            wait_s = self.uploads.submit(f"checkpoint {step}",
                                         lambda: self._upload(step, files, meta))
            uploaded = self.uploads.finished()
        else:
            uploaded = [{"label": f"checkpoint {step}",
                         "result": self._upload(step, files, meta, written)}]
        nbytes = sum(map(len, files.values())) + sum(e["bytes"] for e in written.values())
        return {"path": self.store.checkpoint_dir(step), "bytes": nbytes,
                "snapshot_s": snapshot_s, "wait_s": wait_s,
                "save_s": time.perf_counter() - t0,  # what the caller waited for
                "background": background, "uploaded": uploaded,
                "ledger": audit.as_dict()}

    def _save_shards(self, trainer: Trainer, step: int) -> dict[str, dict[str, Any]]:
        """Every rank's shard files into checkpoint `step`; their manifest entries (all ranks').
        Collectives, in the same order on every rank."""
        from rollart.train.distributed import all_gather_json
        from rollart.train.sharded_state import save_shards

        if trainer.ranks.rank == 0:  # a step written again stops existing before its files
            self.uploads.drain()
            self.store.drop_manifest(step)
        all_gather_json(None, trainer.ranks)  # ... before any rank writes into it
        mine = self.store.write_checkpoint_files(step, save_shards(trainer))
        return {k: v for part in all_gather_json(mine, trainer.ranks) for k, v in part.items()}

    def _upload(self, step: int, files: dict[str, Blob], meta: dict[str, Any],
                written: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        path = self.store.save_checkpoint(step, files, meta, written)
        removed = self.store.prune_checkpoints(self.cfg.storage.keep_last)
        nbytes = sum(map(len, files.values())) + sum(e["bytes"] for e in (written or {}).values())
        upload_s = time.perf_counter() - t0
        return {"step": step, "path": path, "bytes": nbytes, "removed": removed,
                "upload_s": upload_s, "MB_per_s": nbytes / 1e6 / max(upload_s, 1e-9)}

    def flush(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for every background upload (checkpoints, weight versions); raises a failure."""
        return [*self.uploads.drain(timeout), *self.weight_uploads.drain(timeout)]

    def restore(self, trainer: Trainer, step: int) -> dict[str, Any]:
        files, manifest = self.store.load_checkpoint(step)
        trainer.load_checkpoint_files(files)
        if "ledger.json" in files:
            self.ledger = SampleLedger.from_json(files["ledger.json"])
        else:  # older checkpoint: no per-sample record, only the cursor
            self.ledger = SampleLedger(next_iteration=int(manifest.get("iteration", step - 1)) + 1)
        self.pending = []
        if "pending.parquet" in files:
            self.pending = table_to_trajectories(pq.read_table(io.BytesIO(
                files["pending.parquet"])))
        self.rollout_state = files.get("rollout_state.json")
        return {"step": step, "version": trainer.version, "train_step": trainer.step,
                "next_iteration": self.ledger.next_iteration, "pending": len(self.pending),
                "ledger": self.ledger.counts(), "path": self.store.checkpoint_dir(step)}

    # ---- weight versions -----------------------------------------------------------------------
    def _publish(self, version: int, data: bytes, step: int) -> dict[str, Any]:
        rec = publish_weights(self.store, version, data, {"step": step})
        prune_weights(self.store, self.cfg.storage.weights_keep_last)
        return rec

    def publish_async(self, trainer: Trainer) -> float:
        """Queue the current version for upload; returns the seconds the caller waited."""
        version, step, state = trainer.version, trainer.step, trainer.export_weights()
        if trainer.ranks.rank != 0:  # a sharded trainer's other ranks only helped gather
            return 0.0
        return self.weight_uploads.submit(
            f"weights v{version}", lambda: self._publish(version, serialize_weights(state), step))

    def publish_now(self, trainer: Trainer) -> dict[str, Any]:
        self.weight_uploads.drain()
        if trainer.ranks.sharded:  # gathered on every rank's call; rank 0 publishes
            state = trainer.export_weights()
            if trainer.ranks.rank != 0:
                return {"version": trainer.version, "bytes": 0, "publish_s": 0.0}
            return self._publish(trainer.version, serialize_weights(state), trainer.step)
        return self._publish(trainer.version, serialize_weights(trainer.model.state_dict()),
                             trainer.step)
