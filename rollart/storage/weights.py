"""Weight versions in the store: `weights/v{version}/model.safetensors` + `manifest.json` (last).

The direct trainer -> engine transfer stays the default sync; publishing a version here lets
engines elsewhere (another cluster, a later evaluation job) pull any version by number:

    store = RunStore.from_config(cfg.storage, run_id)
    latest_weights_version(store)            # -> 12
    state = load_weights(store, 12)          # dict of tensors, verified against the manifest
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from rollart.storage.files import crc32
from rollart.storage.s3 import StorageError
from rollart.storage.store import MANIFEST, RunStore

if TYPE_CHECKING:  # safetensors loads where tensors are (de)serialized: not in the flow process
    import torch

WEIGHTS_FILE = "model.safetensors"


def _rel(version: int) -> str:
    return f"weights/v{version}"


def tie_key(v: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """Same key for tied tensors (one tensor under two names). Not the storage pointer:
    distinct parameters may be views of one storage (the trainer's parameters adopted into
    the shared-memory weights file, rollart/engines/shared_weights.py)."""
    return v.data_ptr(), v.numel(), v.dtype


def serialize_weights(state: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes; tied tensors are stored once, under the first key."""
    import safetensors.torch

    seen: set[tuple[int, int, torch.dtype]] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        ptr = tie_key(v)
        if ptr in seen:
            continue
        seen.add(ptr)
        out[k] = v.detach().contiguous()
    return safetensors.torch.save(out)


def publish_weights(store: RunStore, version: int, data: bytes,
                    meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Upload one version (weights first, manifest last). Returns a record with timings."""
    t0 = time.perf_counter()
    rel = _rel(version)
    if store.exists(f"{rel}/{MANIFEST}"):  # a re-published version (after resume) is replaced
        store.delete(f"{rel}/{MANIFEST}")
    store.write_bytes(f"{rel}/{WEIGHTS_FILE}", data)
    manifest = {"version": version, "run_id": store.run_id, "created": time.time(),
                "files": {WEIGHTS_FILE: {"bytes": len(data), "crc32": crc32(data)}},
                "bytes": len(data), **(meta or {})}
    store.write_text(f"{rel}/{MANIFEST}", json.dumps(manifest, sort_keys=True, default=str))
    return {"version": version, "bytes": len(data), "publish_s": time.perf_counter() - t0,
            "path": store.uri(rel)}


def weight_versions(store: RunStore, complete: bool = True) -> list[int]:
    versions = sorted(int(n[1:]) for n in store.listdir("weights")
                      if n.startswith("v") and n[1:].isdigit())
    if not complete:
        return versions
    return [v for v in versions if store.exists(f"{_rel(v)}/{MANIFEST}")]


def latest_weights_version(store: RunStore) -> int | None:
    versions = weight_versions(store)
    return versions[-1] if versions else None


def load_weights_bytes(store: RunStore, version: int) -> tuple[bytes, dict[str, Any]]:
    rel = _rel(version)
    try:
        manifest = json.loads(store.read_text(f"{rel}/{MANIFEST}"))
    except FileNotFoundError:
        raise StorageError(f"storage: weight version {version} of run {store.run_id} is not "
                           f"published (no {rel}/{MANIFEST})") from None
    data = store.read_bytes(f"{rel}/{WEIGHTS_FILE}")
    entry = manifest["files"][WEIGHTS_FILE]
    if len(data) != entry["bytes"] or crc32(data) != entry["crc32"]:
        raise StorageError(f"storage: weight version {version} is corrupt or torn")
    return data, manifest


def load_weights(store: RunStore, version: int) -> dict[str, torch.Tensor]:
    data, _ = load_weights_bytes(store, version)
    import safetensors.torch

    return safetensors.torch.load(data)


def prune_weights(store: RunStore, keep_last: int) -> list[int]:
    versions = weight_versions(store, complete=False)
    complete = [v for v in versions if store.exists(f"{_rel(v)}/{MANIFEST}")]
    keep = set(complete[-keep_last:])
    newest = complete[-1] if complete else -1
    removed = [v for v in versions if v not in keep and v < newest]
    for v in removed:
        store.delete(_rel(v))
    return removed


def delete_weights_after(store: RunStore, version: int) -> list[int]:
    """On resume: versions newer than the restored one belong to the abandoned attempt."""
    removed = [v for v in weight_versions(store, complete=False) if v > version]
    for v in removed:
        store.delete(_rel(v))
    return removed


def retie(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tied parameters are stored once: alias each missing key to its tied twin in `model`."""
    own = model.state_dict()
    by_ptr = {tie_key(v): k for k, v in own.items() if k in state}
    out = dict(state)
    for k, v in own.items():
        if k not in out:
            twin = by_ptr.get(tie_key(v))
            if twin is not None:
                out[k] = out[twin]
    return out
