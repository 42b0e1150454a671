"""Exact resume: find the latest complete checkpoint, rebuild the run's config, roll back
whatever the interrupted attempt did after that checkpoint.

Config on resume: the run's own `config.yaml` (what was asked for) is the base and every
`--set` override is re-applied on top (e.g. `iterations=200` extends a run); where the store
lives and how it is reached (`storage.root`, endpoint, region, credentials) comes from the
current invocation, because that is how the run was found. The sample plan depends on `seed`,
`rollout`, `tasks` and `model`, so a resume may not change them.

Which checkpoint: the latest complete one whose manifest is authentic (signed with the run
owner's key, naming only files inside the checkpoint: rollart/storage/integrity.py) and whose
every file matches the manifest's size and SHA-256 and has a sound header
(rollart/storage/formats.py). Any other is skipped with one warning line naming the file and
why, and the previous one is used; nothing of a refused checkpoint is loaded. Unsigned
checkpoints (older versions) are refused too, unless ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1 says
the owner accepts them: then they are re-signed once their CRC32s match (`adopt_unsigned`).

Rollback: checkpoints newer than the one resumed from (torn or corrupt), trajectory shards and
metrics rows of iterations at or after its `next_iteration`, and weight versions newer than its
policy version belong to an attempt whose updates are lost; shards and metrics rows move to
`abandoned/attempt-{n}/`, the rest is deleted, and `resumes.jsonl` records what happened.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from rollart.config import (
    ConfigError,
    RunConfig,
    StorageConfig,
    apply_overrides,
    config_from_dict,
)
from rollart.storage.adopt import adopt_unsigned
from rollart.storage.integrity import CheckpointRefused, accept_unsigned
from rollart.storage.ledger import SampleLedger
from rollart.storage.lock import RunLock
from rollart.storage.run_files import sign_run_files, verify_run_files
from rollart.storage.store import RunStore, checkpoint_rel, shard_rel
from rollart.storage.weights import delete_weights_after

log = logging.getLogger("rollart.storage")
PLAN_KEYS = ("seed", "rollout", "tasks", "model")
LOCATION_KEYS = ("root", "endpoint_url", "region", "profile", "credentials_block",
                 "create_bucket", "retry_timeout_s")


class ResumeError(RuntimeError):
    """Why a run cannot be resumed, in one line."""


@dataclass
class ResumePoint:
    run_id: str
    step: int  # the checkpoint's step
    next_iteration: int  # first iteration the resumed run executes
    version: int  # policy version restored
    checkpoint: str  # its directory
    attempt: int  # 2 for the first resume, ...
    abandoned: dict[str, Any] = field(default_factory=dict)
    corrupt: dict[int, list[str]] = field(default_factory=dict)  # skipped checkpoints' bad files

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stored(store: RunStore) -> dict[str, Any]:
    if not store.exists("config.yaml"):
        raise ResumeError(f"no run {store.run_id!r} under {store.url} (no config.yaml; check "
                          "storage.root and the run id)")
    verify_run_files(store)  # RunFilesRefused (one line) when changed since the run wrote it
    return yaml.safe_load(store.read_text("config.yaml")) or {}


def _located(data: dict[str, Any], location: StorageConfig) -> dict[str, Any]:
    """`data` with where the store is and how it is reached taken from `location`."""
    return {**data, "storage": {**data.get("storage", {}),
                                **{k: getattr(location, k) for k in LOCATION_KEYS}}}


def stored_run_config(location: StorageConfig, run_id: str,
                      overrides: list[str] | None = None) -> RunConfig:
    """The stored config of run `run_id` with `overrides` on top, found through `location`
    (evaluation of a finished run; a resume uses `resume_config`, which also guards the plan).
    """
    data = _stored(RunStore.from_config(location, run_id))
    return config_from_dict(_located(apply_overrides(data, list(overrides or [])), location))


def _stored_for_resume(store: RunStore) -> dict[str, Any]:
    try:
        return _stored(store)
    except ResumeError as err:
        raise ResumeError(f"cannot resume {store.run_id!r}: {err}") from None


def _guard_plan(cfg: RunConfig, base: RunConfig, run_id: str) -> RunConfig:
    """`cfg`, unless it changes a plan-defining key of the stored run config `base`."""
    for key in PLAN_KEYS:
        if getattr(cfg, key) != getattr(base, key):
            raise ResumeError(
                f"cannot resume {run_id!r} with a different '{key}': the sample plan and "
                "its ledger depend on it (start a new run instead)"
            )
    return cfg


def resume_config(current: RunConfig, overrides: list[str], store: RunStore) -> RunConfig:
    """The config a resumed run uses (see the module docstring)."""
    stored = _stored_for_resume(store)
    merged = _located(apply_overrides(copy.deepcopy(stored), list(overrides)), current.storage)
    try:
        cfg = config_from_dict(merged)
    except ConfigError as err:
        raise ResumeError(f"cannot resume {store.run_id!r}: {err}") from None
    base = config_from_dict({**stored, "storage": merged["storage"]})
    return _guard_plan(cfg, base, store.run_id)


def resume_whole_config(cfg: RunConfig, store: RunStore) -> RunConfig:
    """A resume with `cfg` as the run's whole config (the in-process mode takes a built
    config, not a file and overrides): used as given, under the same guard as `resume_config`
    (a plan-defining key that differs from the stored run config is refused)."""
    base = config_from_dict(_located(_stored_for_resume(store), cfg.storage))
    return _guard_plan(cfg, base, store.run_id)


def _problems(store: RunStore, step: int) -> dict[str, str]:
    """{file: why} checkpoint `step` cannot be resumed from ({} when it can); an unsigned one
    is accepted (re-signed) here when the owner said so."""
    try:
        return store.checkpoint_problems(step)
    except CheckpointRefused as err:
        if not (err.unsigned and accept_unsigned()):
            return {name: err.reason for name in err.files}
    log.warning("storage: accepting unsigned checkpoint %d of run %r (%s=1): re-signing it "
                "with this user's key", step, store.run_id, "ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS")
    try:
        return adopt_unsigned(store, step) or store.checkpoint_problems(step)
    except CheckpointRefused as err:
        return {name: err.reason for name in err.files}


def find_resume_point(store: RunStore,
                      corrupt: dict[int, list[str]] | None = None) -> tuple[int, dict[str, Any]]:
    """The latest complete checkpoint that is authentic and intact (module docstring), and its
    manifest. Others are skipped with one warning line each and noted in `corrupt` (step ->
    bad files)."""
    corrupt = {} if corrupt is None else corrupt
    newest = ""
    for step in reversed(store.list_checkpoints()):
        bad = _problems(store, step)
        if not bad:
            return step, store.read_manifest(step)
        corrupt[step] = list(bad)
        why = " ".join("; ".join(f"{name} {reason}" for name, reason in bad.items()).split())
        newest = newest or f"checkpoint {step}: {why}"
        log.warning("storage: checkpoint %d of run %r is corrupt or not authentic (%s; under "
                    "%s); falling back to the previous complete checkpoint", step,
                    store.run_id, why, store.checkpoint_dir(step))
    torn = sorted(set(store.checkpoint_steps()) - set(corrupt))
    raise ResumeError(
        f"cannot resume {store.run_id!r}: no complete checkpoint under {store.url}/checkpoints"
        + (f" (only torn ones: {torn})" if torn else "")
        + (f" (corrupt or not authentic: {corrupt}; newest {newest})" if corrupt else ""))


def prepare_resume(store: RunStore) -> ResumePoint:
    """Pick the latest intact complete checkpoint and roll the store back to it."""
    corrupt: dict[int, list[str]] = {}
    step, manifest = find_resume_point(store, corrupt)
    files, _ = store.load_checkpoint(step, only=["ledger.json"])
    if "ledger.json" in files:
        next_it = SampleLedger.from_json(files["ledger.json"]).next_iteration
    else:  # checkpoints from before the ledger: the sync loop checkpoints after iteration `it`
        next_it = int(manifest.get("iteration", step - 1)) + 1
    version = int(manifest.get("version", step))
    attempt = len(store.read_jsonl("resumes.jsonl")) + 2
    abandoned = rollback(store, step, next_it, version, attempt)
    point = ResumePoint(store.run_id, step, next_it, version, store.checkpoint_dir(step), attempt,
                        abandoned, corrupt)
    store.append_jsonl("resumes.jsonl", {**point.as_dict(), "at": time.time()})
    return point


def rollback(store: RunStore, step: int, next_iteration: int, version: int,
             attempt: int) -> dict[str, Any]:
    """Undo what the interrupted attempt did after checkpoint `step` (module docstring)."""
    dest = f"abandoned/attempt-{attempt - 1}"
    torn = [s for s in store.checkpoint_steps() if s > step]
    for s in torn:
        store.delete(checkpoint_rel(s))
    shard_steps = [s for s in store.shard_steps() if s >= next_iteration]
    for s in shard_steps:
        for name in store.listdir(shard_rel(s)):
            src = f"{shard_rel(s)}/{name}"
            store.write_bytes(f"{dest}/{src}", store.read_bytes(src))
        store.delete(shard_rel(s))
    rows, torn_tail = store.read_jsonl_torn("metrics.jsonl")  # a torn last row: dropped, warned
    keep = [r for r in rows if int(r.get("iteration", -1)) < next_iteration]
    dropped_rows = [r for r in rows if int(r.get("iteration", -1)) >= next_iteration]
    if dropped_rows:
        store.write_jsonl(f"{dest}/metrics.jsonl", dropped_rows)
    if dropped_rows or torn_tail:  # rewritten whole, so the next append starts on a fresh line
        store.write_jsonl("metrics.jsonl", keep)
    weights = delete_weights_after(store, version)
    return {"torn_checkpoints": torn, "shard_iterations": shard_steps,
            "metrics_rows": len(dropped_rows), "weight_versions": weights,
            "moved_to": dest if (shard_steps or dropped_rows) else None}


def describe(point: ResumePoint) -> str:
    a = point.abandoned
    skipped = "".join(f"; skipped corrupt checkpoint {s} ({', '.join(bad)})"
                      for s, bad in sorted(point.corrupt.items(), reverse=True))
    return (f"resuming {point.run_id} from checkpoint {point.step} (policy version "
            f"{point.version}) at iteration {point.next_iteration}{skipped}; rolled back "
            f"{len(a.get('torn_checkpoints', []))} torn or corrupt checkpoint(s), "
            f"{len(a.get('shard_iterations', []))} shard iteration(s), "
            f"{a.get('metrics_rows', 0)} metrics row(s)")


def dumps(point: ResumePoint) -> str:
    return json.dumps(point.as_dict(), sort_keys=True)


FLOW_RESUME_HINT = "--resume (flow parameter `resume`)"


def start_run(cfg: RunConfig, overrides: list[str] | None, run_id: str, resume: bool,
              lock: RunLock | None = None,
              resume_hint: str = FLOW_RESUME_HINT) -> tuple[RunConfig, ResumePoint | None]:
    """At a run's start, before any cluster or service: check the store (one-line
    StorageError), take the run's writer `lock` (RunLockedError naming the holder; the caller
    releases it when the run ends), then either refuse to reuse a run id that has checkpoints
    (the refusal says how to resume: `resume_hint`) or prepare the resume (ResumeError).
    `overrides` re-apply on the stored run config on resume (`resume_config`); None: `cfg` is
    the run's whole config (`resume_whole_config`). Writes the run's requested config
    (`config.yaml`, the base of a resume)."""
    from rollart.config import dump_config
    from rollart.storage.s3 import check_storage

    check_storage(cfg.storage)
    if lock is not None:  # before any file of the run is touched (rollback included)
        lock.acquire()
    store = RunStore.from_config(cfg.storage, run_id)
    point = None
    if resume:
        cfg = (resume_whole_config(cfg, store) if overrides is None
               else resume_config(cfg, overrides, store))
        store = RunStore.from_config(cfg.storage, run_id)
        point = prepare_resume(store)
    elif store.latest_checkpoint() is not None:
        raise ResumeError(f"run {run_id!r} already has checkpoints under {store.url}; resume it "
                          f"with {resume_hint} or pick another run id")
    elif store.checkpoint_steps() or store.shard_steps() or store.exists("metrics.jsonl"):
        # An attempt died before its first complete checkpoint: start over, keep its data aside.
        attempt = len(store.read_jsonl("resumes.jsonl")) + 2
        store.append_jsonl("resumes.jsonl", {"run_id": run_id, "step": 0, "next_iteration": 0,
                                             "attempt": attempt, "at": time.time(),
                                             "abandoned": rollback(store, 0, 0, 0, attempt)})
    store.write_text("config.yaml", dump_config(cfg))
    sign_run_files(store)
    return cfg, point
