"""Tamper-evident checkpoints: the manifest is authenticated with a key only the run's owner
holds, and it confines every name it lists to the checkpoint's directory.

Whoever can write the store (another local user, a compromised job, a shared bucket) could
otherwise rewrite a checkpoint's files and its manifest together: sizes and CRC32s are easy to
recompute, so the owner's `--resume` would load their weights without a word. So:

- Every file's entry holds its size, CRC32 and SHA-256. The CRC32 alone would not do even in an
  authenticated manifest: a forger who picks a file's bytes can give it any CRC32 (four bytes
  they choose); a SHA-256 they cannot match.
- The manifest carries `hmac_sha256`: HMAC-SHA256, with the owner's checkpoint key
  (rollart/secrets.py `checkpoint_key`), over `DOMAIN` + the canonical bytes of everything else
  in it (JSON, sorted keys, no whitespace: `canonical`), which includes `run_id` and `step`, so
  an authentic manifest copied into another run or step is refused too, and `key_id` (a hash of
  the key, never the key), so a checkpoint signed with another key says so.
- A listed name must be a relative path of at most `MAX_DEPTH` plain components
  (`[A-Za-z0-9_][A-Za-z0-9._-]*`: no `..`, no absolute path, no backslash, nothing hidden), so
  nothing outside `checkpoints/{step:08d}/` is ever looked up or read (a sharded trainer's
  `dcp/shard-....safetensors` stays allowed). Checked before any file is touched.

A refusal is `CheckpointRefused`: one line naming the checkpoint, the file and why. The resume
(rollart/storage/resume.py) falls back to the previous authentic, intact checkpoint.

Unsigned checkpoints (written before this, or with their MAC stripped) are refused unless the
owner accepts them explicitly: `ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1` for a resume, or
`python -m rollart.storage.adopt ROOT RUN_ID [STEP ...]` (rollart/storage/adopt.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Any

from rollart.storage.blob import Blob, crc32, sha256
from rollart.storage.formats import format_problem
from rollart.storage.s3 import StorageError

MAC_FIELD = "hmac_sha256"
KEY_ID_FIELD = "key_id"
DOMAIN = b"rollart checkpoint manifest v1\n"
ACCEPT_UNSIGNED_VAR = "ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS"
MANIFEST = "manifest.json"
MAX_DEPTH = 2
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CheckpointRefused(StorageError):
    """A checkpoint that is not loaded, in one line: which one, which file, why. `unsigned`:
    refused only for want of a MAC (the owner may accept it explicitly)."""

    def __init__(self, step: int, run_id: str, name: str, reason: str,
                 unsigned: bool = False) -> None:
        self.step, self.files, self.reason, self.unsigned = step, [name], reason, unsigned
        super().__init__(f"storage: checkpoint {step} of run {run_id!r} refused: {name} "
                         f"{reason}")


def safe_name(name: Any) -> bool:
    """A name that stays inside the checkpoint directory (see the module docstring)."""
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        return False
    parts = name.split("/")
    return len(parts) <= MAX_DEPTH and all(_COMPONENT.fullmatch(p) for p in parts)


def unsafe_names(manifest: dict[str, Any]) -> list[str]:
    files = manifest.get("files")
    return [n for n in files if not safe_name(n)] if isinstance(files, dict) else []


def digests(data: Blob) -> dict[str, Any]:
    """A file's manifest entry. hashlib and zlib drop the GIL on large buffers."""
    return {"bytes": len(data), "crc32": crc32(data), "sha256": sha256(data).hexdigest()}


def key_id(key: bytes) -> str:
    """Names the key (which key signed this?) without revealing anything about it."""
    return hashlib.sha256(b"rollart checkpoint key id\n" + key).hexdigest()[:16]


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes the MAC covers: every field but the MAC, as sorted compact JSON."""
    body = {k: v for k, v in manifest.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def mac_of(manifest: dict[str, Any], key: bytes, domain: bytes = DOMAIN) -> str:
    """The MAC of `manifest` under `domain` (a checkpoint manifest's by default; the run's
    signed file list, rollart/storage/run_files.py, has a domain of its own, so neither can
    pass for the other)."""
    return hmac.new(key, domain + canonical(manifest), hashlib.sha256).hexdigest()


def signature_problem(doc: dict[str, Any], key: bytes, domain: bytes = DOMAIN) -> str | None:
    """Why `doc` (written by `sign` under `domain`) is not authentic under `key`; None when it
    is. Checked the same way for a checkpoint manifest and for the run's signed file list."""
    if doc.get(KEY_ID_FIELD) != key_id(key):
        return ("was signed with another checkpoint key (key id "
                f"{str(doc.get(KEY_ID_FIELD))[:16]!r}, this process holds {key_id(key)!r})")
    mac = doc.get(MAC_FIELD)
    if not isinstance(mac, str) or not hmac.compare_digest(mac, mac_of(doc, key, domain)):
        return "is not authentic (HMAC-SHA256 mismatch: changed after the run wrote it)"
    return None


def sign(manifest: dict[str, Any], key: bytes, domain: bytes = DOMAIN) -> dict[str, Any]:
    """`manifest` as JSON will read it back (so writer and reader canonicalise the same
    values), with `key_id` and the MAC added."""
    out = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MAC_FIELD},
                                default=str))
    out[KEY_ID_FIELD] = key_id(key)
    out[MAC_FIELD] = mac_of(out, key, domain)
    return out


def owner_key(step: int, run_id: str, create: bool = False) -> bytes:
    """The key checkpoint `step` is checked (or re-signed) with; CheckpointRefused when this
    process has none, so a run without its owner's key loads nothing."""
    from rollart.secrets import CheckpointKeyError, checkpoint_key  # lazy: distributed

    try:
        key = checkpoint_key(create=create)
    except CheckpointKeyError as err:
        raise CheckpointRefused(step, run_id, MANIFEST, f"cannot be checked: {err}") from None
    if key is None:
        raise CheckpointRefused(step, run_id, MANIFEST, "cannot be checked: this process "
                                "holds no checkpoint key (ROLLART_CHECKPOINT_KEY, or "
                                "<state dir>/checkpoint-key of the run's owner)")
    return key


def signing_key() -> bytes:
    """The key a writer signs with (the state directory's is created on first use)."""
    from rollart.secrets import CheckpointKeyError, checkpoint_key

    try:
        key = checkpoint_key(create=True)
    except CheckpointKeyError as err:
        raise StorageError(f"storage: cannot sign checkpoints: {err}") from None
    assert key is not None
    return key


def verify_manifest(manifest: dict[str, Any], step: int, run_id: str) -> None:
    """Raise CheckpointRefused unless `manifest` is checkpoint `step` of `run_id`, signed with
    this process's key, listing only confined names with well-formed entries."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointRefused(step, run_id, MANIFEST, "lists no files")
    bad = unsafe_names(manifest)
    if bad:  # before any lookup: never a size or digest of a file outside the checkpoint
        raise CheckpointRefused(step, run_id, MANIFEST, f"lists {bad[0][:80]!r}, a name "
                                "outside the checkpoint directory")
    mac = manifest.get(MAC_FIELD)
    if mac is None:
        raise CheckpointRefused(
            step, run_id, MANIFEST, "is unsigned (written before rollart authenticated "
            f"checkpoints, or its MAC was removed); accept it with {ACCEPT_UNSIGNED_VAR}=1 "
            "on the resume, or `python -m rollart.storage.adopt ROOT RUN_ID`, only if "
            "you trust the store", unsigned=True)
    why = signature_problem(manifest, owner_key(step, run_id))
    if why:
        raise CheckpointRefused(step, run_id, MANIFEST, why)
    if manifest.get("step") != step or manifest.get("run_id") != run_id:
        raise CheckpointRefused(step, run_id, MANIFEST, "is authentic but belongs to "
                                f"run {manifest.get('run_id')!r} step {manifest.get('step')} "
                                "(copied here)")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"])):
            raise CheckpointRefused(step, run_id, name, "has a malformed manifest entry")


def file_problem(name: str, data: bytes, entry: Any) -> str | None:
    """Why file `name` does not match its manifest entry or cannot be loaded; None when it is
    intact. Signed entries are checked by SHA-256, unsigned ones by CRC32."""
    want = entry if isinstance(entry, dict) else {"bytes": entry}
    if len(data) != want.get("bytes"):
        return f"is torn ({len(data)} bytes, the manifest says {want.get('bytes')})"
    if "sha256" in want:
        if not hmac.compare_digest(hashlib.sha256(data).hexdigest(), str(want["sha256"])):
            return "does not match its SHA-256 in the manifest (corrupt or altered)"
    elif "crc32" in want and crc32(data) != want["crc32"]:
        return "does not match its CRC32 in the manifest (corrupt)"
    return format_problem(name, data)


def accept_unsigned() -> bool:
    """The owner's explicit choice to accept (re-sign) unsigned checkpoints."""
    return os.environ.get(ACCEPT_UNSIGNED_VAR, "").strip().lower() in ("1", "true", "yes")
