"""The run's own files (`config.yaml` and the `tokenizer/` directory) authenticated like its
checkpoints.

A resume and an evaluation rebuild the run from its stored `config.yaml` (the tasks, the model
directory, the reward endpoint) and its tokenizer (which includes the chat template), so
whoever can write the store could otherwise steer the owner's next resume without touching a
checkpoint. The run's owner therefore signs `run-files.json`: every such file with its size,
CRC32 and SHA-256, the run id, and an HMAC-SHA256 with the checkpoint key
(rollart/storage/integrity.py) under a domain of its own, so a checkpoint manifest cannot pass
for it or it for one.

- Signed by the owner's process (the flow, or the in-process loop) after it writes
  `config.yaml` and after the prepare stage wrote the tokenizer: env workers, which run
  untrusted task code, never hold the key.
- Checked before `config.yaml` is read for a resume or an evaluation: a changed, added or
  missing file is refused in one line (`RunFilesRefused`) naming the file, before any service
  starts.
- A run written before this has no `run-files.json`: refused like an unsigned checkpoint,
  unless the owner accepts it with `ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1` (then it is signed
  as it stands, with a warning).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import TYPE_CHECKING, Any

from rollart.storage.integrity import (
    ACCEPT_UNSIGNED_VAR,
    CheckpointRefused,
    accept_unsigned,
    digests,
    owner_key,
    sign,
    signature_problem,
    signing_key,
)
from rollart.storage.s3 import StorageError

if TYPE_CHECKING:
    from rollart.storage.store import RunStore

RUN_FILES = "run-files.json"
RUN_DOMAIN = b"rollart run files v1\n"
CONFIG = "config.yaml"
TOKENIZER = "tokenizer"
log = logging.getLogger("rollart.storage")


class RunFilesRefused(StorageError):
    """The run's stored config or tokenizer is not what its owner wrote, in one line."""

    def __init__(self, run_id: str, name: str, reason: str, unsigned: bool = False) -> None:
        self.files, self.reason, self.unsigned = [name], reason, unsigned
        super().__init__(f"storage: run {run_id!r} refused: {name} {reason}")


def covered_names(store: RunStore) -> list[str]:
    """The run files that exist in the store: `config.yaml` and everything under
    `tokenizer/`, as paths relative to the run."""
    names = [CONFIG] if store.exists(CONFIG) else []
    prefix = store.path(TOKENIZER)

    def find() -> list[str]:
        try:
            return sorted(p[len(prefix) + 1:] for p in store.fs.find(prefix))
        except FileNotFoundError:
            return []

    return names + [f"{TOKENIZER}/{n}" for n in store._io(f"list {TOKENIZER}", find)]


def sign_run_files(store: RunStore) -> dict[str, Any]:
    """Sign the run files as they are now (the owner's process, right after writing them)."""
    names = covered_names(store)
    raw = store.read_many(names) if names else {}
    body = {"run_id": store.run_id, "files": {n: digests(raw[n]) for n in names}}
    signed = sign(body, signing_key(), RUN_DOMAIN)
    store.write_text(RUN_FILES, json.dumps(signed, indent=1, sort_keys=True))
    return signed


def _signed_list(store: RunStore) -> dict[str, Any]:
    run_id = store.run_id
    try:
        listed = json.loads(store.read_text(RUN_FILES))
    except FileNotFoundError:
        raise RunFilesRefused(
            run_id, RUN_FILES, "is missing (a run written before rollart signed its config "
            f"and tokenizer, or the file was removed); accept the run as it stands with "
            f"{ACCEPT_UNSIGNED_VAR}=1 only if you trust the store", unsigned=True) from None
    except ValueError:
        raise RunFilesRefused(run_id, RUN_FILES, "is not JSON") from None
    if not isinstance(listed, dict) or not isinstance(listed.get("files"), dict):
        raise RunFilesRefused(run_id, RUN_FILES, "lists no files")
    try:
        key = owner_key(-1, run_id)
    except CheckpointRefused as err:
        raise RunFilesRefused(run_id, RUN_FILES, err.reason) from None
    why = signature_problem(listed, key, RUN_DOMAIN)
    if why:
        raise RunFilesRefused(run_id, RUN_FILES, why)
    if listed.get("run_id") != run_id:
        raise RunFilesRefused(run_id, RUN_FILES, f"is authentic but belongs to run "
                              f"{listed.get('run_id')!r} (copied here)")
    return listed


def verify_run_files(store: RunStore) -> None:
    """Raise RunFilesRefused unless every run file is exactly as its owner signed it: none
    changed, none added, none missing (see the module docstring for unsigned runs)."""
    try:
        listed = _signed_list(store)["files"]
    except RunFilesRefused as err:
        if not (err.unsigned and accept_unsigned()):
            raise
        log.warning("storage: accepting the unsigned config and tokenizer of run %r (%s=1): "
                    "signing them as they stand with this user's key", store.run_id,
                    ACCEPT_UNSIGNED_VAR)
        sign_run_files(store)
        return
    present = covered_names(store)
    for name in present:
        if name not in listed:
            raise RunFilesRefused(store.run_id, name, "was added after the run signed its "
                                  "files")
    for name in listed:
        if name not in present:
            raise RunFilesRefused(store.run_id, name, "is missing (the run signed it)")
    raw = store.read_many(present) if present else {}
    for name in present:
        want = listed[name].get("sha256") if isinstance(listed[name], dict) else None
        if not hmac.compare_digest(hashlib.sha256(raw[name]).hexdigest(), str(want)):
            raise RunFilesRefused(store.run_id, name, f"does not match its SHA-256 in "
                                  f"{RUN_FILES} (changed after the run wrote it)")
