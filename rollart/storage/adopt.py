"""Accepting unsigned checkpoints (written before rollart authenticated checkpoints), by the
run's owner and only when they say so.

An unsigned checkpoint is refused (rollart/storage/integrity.py). The owner who trusts the
store accepts one with `ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1` on a resume (the resume accepts
the checkpoints it tries) or with

    python -m rollart.storage.adopt ROOT RUN_ID [STEP ...]

(every unsigned complete checkpoint of the run, or these steps; an S3 root takes its
credentials from the environment). Accepting checks every file against the manifest's size,
CRC32 and header, then re-signs the manifest, with SHA-256s, with this user's key; from then
on the checkpoint is like any other. A run that already has a signed checkpoint never has an
unsigned one accepted: there a missing MAC means it was removed (a downgrade), not an old
checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rollart.storage.checkpoint_store import LINK_OUT
from rollart.storage.integrity import (
    MAC_FIELD,
    MANIFEST,
    CheckpointRefused,
    digests,
    file_problem,
    owner_key,
    sign,
    unsafe_names,
    verify_manifest,
)
from rollart.storage.s3 import StorageError
from rollart.storage.store import RunStore, checkpoint_rel


def run_is_signed(store: RunStore) -> bool:
    """Whether any complete checkpoint of the run carries a MAC (then no unsigned one is an
    old checkpoint: it is a downgrade)."""
    return any(MAC_FIELD in (store.unverified_manifest(s) or {})
               for s in store.list_checkpoints())


def adopt_unsigned(store: RunStore, step: int) -> dict[str, str]:
    """Accept unsigned checkpoint `step`: check every file against the manifest's size and
    CRC32 and its header, then re-sign the manifest (with SHA-256s) with this process's key.
    Returns {file: problem} instead when a file is bad (nothing is re-signed then)."""
    rel = checkpoint_rel(step)
    manifest = store.unverified_manifest(step)
    if manifest is None or MAC_FIELD in manifest:
        raise CheckpointRefused(step, store.run_id, MANIFEST, "is not an unsigned manifest")
    if unsafe_names(manifest) or not isinstance(manifest.get("files"), dict):
        verify_manifest(manifest, step, store.run_id)  # raises, naming the bad name
    if run_is_signed(store):
        raise CheckpointRefused(step, store.run_id, MANIFEST, "is unsigned in a run whose other "
                                "checkpoints are signed (its MAC was removed); not accepted")
    if manifest.get("step") != step or manifest.get("run_id") != store.run_id:
        raise CheckpointRefused(step, store.run_id, MANIFEST, "belongs to run "
                                f"{manifest.get('run_id')!r} step {manifest.get('step')}")
    key = owner_key(step, store.run_id, create=True)
    problems: dict[str, str] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in manifest["files"].items():
        if store.outside_checkpoint(step, name):
            problems[name] = LINK_OUT
            continue
        try:
            data = store.read_bytes(f"{rel}/{name}")
        except FileNotFoundError:
            problems[name] = "is missing"
            continue
        problem = file_problem(name, data, entry)
        if problem:
            problems[name] = problem
        entries[name] = digests(data)
    if problems:
        return problems
    adopted = {**manifest, "files": entries, "adopted_unsigned": time.time()}
    store.write_text(f"{rel}/{MANIFEST}", json.dumps(sign(adopted, key), indent=2,
                                                     sort_keys=True))
    return {}


def main(argv: list[str] | None = None) -> int:
    """`python -m rollart.storage.adopt ROOT RUN_ID [STEP ...]`: accept (re-sign) the run's
    unsigned complete checkpoints, or the given steps, with this user's key."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    store = RunStore(args[0], args[1])
    steps = [int(s) for s in args[2:]] or store.list_checkpoints()
    code = 0
    for step in steps:
        try:
            if MAC_FIELD in (store.unverified_manifest(step) or {}):
                print(f"checkpoint {step}: signed already")
                continue
            problems = adopt_unsigned(store, step)
        except StorageError as err:
            print(err, file=sys.stderr)
            code = 1
            continue
        if problems:
            print(f"checkpoint {step}: not accepted: " + "; ".join(
                f"{n} {p}" for n, p in problems.items()), file=sys.stderr)
            code = 1
        else:
            print(f"checkpoint {step}: accepted and signed")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
