"""Tamper-evident checkpoints (rollart/storage/integrity.py): whoever can write the store but
does not hold the run owner's checkpoint key cannot make a resume, or an engine serving a
checkpoint, load their bytes; a manifest cannot make a resume read outside the checkpoint; no
pickle is loaded; a corrupt file header falls back like a CRC mismatch. Every refusal is one
line naming the file.

The victim run is the in-process loop (`run_local`: the flow's stages, trainer, engine,
checkpointer and store), 2 iterations with a checkpoint after each; each test attacks a copy of
its store. The owner's key is ROLLART_CHECKPOINT_KEY in this process (monkeypatched); the
attacker recomputes everything that needs no key.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from rollart import secrets
from rollart.runner.local_loop import run_local
from rollart.storage.adopt import adopt_unsigned
from rollart.storage.integrity import MAC_FIELD, CheckpointRefused, safe_name
from rollart.storage.resume import ResumeError, find_resume_point
from rollart.storage.store import RunStore
from tests.security.owner_run import (
    ATTACKER_KEY,
    OWNER_KEY,
    RUN,
    become_owner,
    copy_of_store,
    owners_config,
    owners_run,
)

CKPT2 = "checkpoints/00000002"


@pytest.fixture(autouse=True)
def owner(monkeypatch, tmp_path):
    become_owner(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """The owner's run: checkpoints 1 and 2 (and the run's in-process engine)."""
    root = tmp_path_factory.mktemp("victim")
    return root, owners_run(root, 2)["engines"][0]


@pytest.fixture
def store(victim, tmp_path) -> RunStore:
    return copy_of_store(victim[0], tmp_path)


@contextlib.contextmanager
def warnings_of(name: str):
    """WARNING records of logger `name`, caught on the logger itself."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _manifest(store: RunStore, step: int = 2) -> dict:
    return json.loads(store.read_text(f"checkpoints/{step:08d}/manifest.json"))


_POLY = 0xEDB88320
_TABLE = [0] * 256
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (_POLY if _c & 1 else 0)
    _TABLE[_i] = _c
_BY_TOP = {v >> 24: i for i, v in enumerate(_TABLE)}


def _with_crc32(data: bytes, target: int) -> bytes:
    """`data` with its last 4 bytes changed so that its CRC32 is `target` (CRC32 is linear: the
    4 table indices that reach `target` are found backwards, then the bytes forwards)."""
    prefix, c, idx = data[:-4], target ^ 0xFFFFFFFF, []
    for _ in range(4):
        idx.append(_BY_TOP[c >> 24])
        c = ((c ^ _TABLE[idx[-1]]) << 8) & 0xFFFFFFFF
    s, tail = zlib.crc32(prefix) ^ 0xFFFFFFFF, bytearray()
    for i in reversed(idx):
        tail.append((s ^ i) & 0xFF)
        s = _TABLE[i] ^ (s >> 8)
    out = prefix + bytes(tail)
    assert zlib.crc32(out) & 0xFFFFFFFF == target
    return out


def _forge(store: RunStore, files: dict[str, bytes], how: str, step: int = 2) -> None:
    """The attacker: replace `files` in checkpoint `step` using only what needs no key.
    "crc32": each file's bytes made to match the CRC32 (and size) in the manifest, which is
    left untouched (its MAC stays valid); otherwise the manifest is rewritten with new sizes,
    CRC32s and SHA-256s, keeping the owner's now stale MAC ("sha256"), dropping it
    ("unsigned"), or signed with the attacker's own key ("own key")."""
    rel = f"checkpoints/{step:08d}"
    manifest = _manifest(store, step)
    if how == "crc32":
        for name, data in files.items():
            want = manifest["files"][name]
            assert len(data) == want["bytes"]
            store.write_bytes(f"{rel}/{name}", _with_crc32(data, want["crc32"]))
        return
    for name, data in files.items():
        store.write_bytes(f"{rel}/{name}", data)
        entry = manifest["files"][name]
        entry.update(bytes=len(data), crc32=zlib.crc32(data) & 0xFFFFFFFF)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
    if how == "unsigned":
        manifest.pop(MAC_FIELD)
        manifest.pop("key_id")
    elif how == "own key":
        from rollart.storage.integrity import sign

        manifest = sign(manifest, bytes.fromhex(ATTACKER_KEY))
    store.write_text(f"{rel}/manifest.json", json.dumps(manifest, indent=2, sort_keys=True))


def _zeroed_weights(store: RunStore) -> bytes:
    weights = safetensors.torch.load(store.read_bytes(f"{CKPT2}/model.safetensors"))
    return safetensors.torch.save({k: torch.zeros_like(v) for k, v in weights.items()})


def _one_line_refusal(records: list[logging.LogRecord], *fragments: str) -> str:
    msgs = [r.getMessage() for r in records if "checkpoint 2" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "\n" not in msgs[0] and all(f in msgs[0] for f in fragments), msgs[0]
    return msgs[0]


@pytest.mark.parametrize("how, why", [
    ("crc32", "model.safetensors does not match its SHA-256"),  # CRC32 matched, manifest kept
    ("sha256", "manifest.json is not authentic"),  # every digest recomputed: the MAC is not
    ("unsigned", "manifest.json is unsigned"),  # MAC removed: looks like an old checkpoint
    ("own key", "manifest.json was signed with another checkpoint key"),
])
def test_zeroed_weights_are_refused_and_the_resume_falls_back(store, how, why):
    _forge(store, {"model.safetensors": _zeroed_weights(store)}, how)
    with warnings_of("rollart.storage") as records:
        step, _ = find_resume_point(store)
    assert step == 1
    _one_line_refusal(records, why, "falling back")


def test_the_real_resume_loads_the_previous_checkpoint_not_the_forgery(store, victim):
    """The issue's probe: zeroed weights, CRCs (and SHA-256s) recomputed. `--resume` (the
    in-process loop) warns in one line and resumes from checkpoint 1; the engine serving the
    forged checkpoint (evaluation) refuses it in one line, before loading a weight."""
    good = store.read_bytes("checkpoints/00000001/model.safetensors")
    _forge(store, {"model.safetensors": _zeroed_weights(store)}, "sha256")
    engine = victim[1]
    engine.store = store
    with pytest.raises(CheckpointRefused, match=r"checkpoint 2 .*manifest.json is not "
                       r"authentic") as info:
        engine.load_checkpoint(2)
    assert "\n" not in str(info.value)
    assert engine.load_checkpoint(1)["step"] == 1
    cfg = owners_config(store.root, 3)
    with warnings_of("rollart.storage") as records:
        out = run_local(cfg, RUN, resume=True)
    assert out["resumed_from"] == 1
    _one_line_refusal(records, "manifest.json is not authentic")
    trainer = out["trainer"].trainer
    assert any(v.abs().sum() > 0 for v in trainer.model.state_dict().values())
    assert store.list_checkpoints() == [1, 2, 3]  # 2 rolled back, then written again
    assert store.read_bytes("checkpoints/00000001/model.safetensors") == good
    store.load_checkpoint(3)  # the resumed run's checkpoints are signed with the owner's key


@pytest.mark.parametrize("name", ["../../../../../secret.txt", "/etc/shadow",
                                  "dcp/../../../../../../secret.txt", "a\\..\\..\\secret.txt",
                                  ".hidden", "dcp/a/b.safetensors", ""])
@pytest.mark.parametrize("signed", [False, True])
def test_a_manifest_name_outside_the_checkpoint_is_refused_before_any_read(
        store, tmp_path, name, signed):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    manifest = _manifest(store)
    manifest["files"][name] = {"bytes": secret.stat().st_size, "crc32": 0, "sha256": "0" * 64}
    if signed:  # even the key holder cannot list one (a bug, or a stolen key)
        from rollart.storage.integrity import sign

        manifest = sign(manifest, bytes.fromhex(OWNER_KEY))
    store.write_text(f"{CKPT2}/manifest.json", json.dumps(manifest))
    looked_up: list[str] = []
    for method in ("size", "read_bytes", "read_many", "exists"):
        real = getattr(store, method)

        def spy(arg, *a, _real=real, **k):
            looked_up.extend([arg] if isinstance(arg, str) else list(arg))
            return _real(arg, *a, **k)

        setattr(store, method, spy)
    with warnings_of("rollart.storage") as records:
        step, _ = find_resume_point(store)
    assert step == 1
    _one_line_refusal(records, "manifest.json lists", "outside the checkpoint directory")
    assert not any("secret" in p or p.startswith("/") or ".." in p or "\\" in p
                   for p in looked_up), looked_up
    with pytest.raises(CheckpointRefused, match="outside the checkpoint directory"):
        store.load_checkpoint(2)


@pytest.mark.parametrize("link", ["file", "directory"])
def test_a_symlink_out_of_the_checkpoint_is_not_followed(store, tmp_path, link):
    """The manifest stays authentic; a listed file (or the checkpoint directory itself) is
    swapped for a symlink to a file the run can read: never read through, one line."""
    ckpt = Path(store.path(CKPT2))
    outside = tmp_path / "elsewhere"
    shutil.copytree(ckpt, outside)
    (outside / "model.safetensors").write_bytes(b"root:$6$secret-hash:19000:0:99999:7:::\n")
    if link == "file":
        (ckpt / "model.safetensors").unlink()
        (ckpt / "model.safetensors").symlink_to(outside / "model.safetensors")
    else:
        shutil.rmtree(ckpt)
        ckpt.symlink_to(outside, target_is_directory=True)
    with warnings_of("rollart.storage") as records:
        assert find_resume_point(store)[0] == 1
    msg = _one_line_refusal(records, "link out of the checkpoint directory")
    assert "bytes" not in msg  # nothing about the file behind the link
    with pytest.raises(CheckpointRefused, match="link out of the checkpoint directory"):
        store.load_checkpoint(2, only=["model.safetensors"])


def test_names_a_sharded_trainer_writes_stay_allowed():
    assert safe_name("dcp/shard-00001-model-00001-of-00001.safetensors")
    assert safe_name("model.safetensors") and safe_name("engine_rng.safetensors")
    for bad in ("../x", "/x", "a\\b", "dcp/../x", "dcp//x", "./x", "x/", ".x", "a/b/c", None):
        assert not safe_name(bad), bad


class _Payload:
    """Unpickling this creates a marker file: code execution, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_in_the_engine_rng_file_is_never_loaded(store, victim, tmp_path):
    """A pickle named as the old format (engine_rng.pt, in a checkpoint whose manifest is
    signed: the owner accepted an old checkpoint, or a key holder's bug) is not read: one
    warning line, a fresh seed. In the new format's name (engine_rng.safetensors) it fails the
    header check: the resume falls back, the engine refuses the file, in one line each."""
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save([_Payload(marker)], buf)
    rel = CKPT2
    files, manifest = store.load_checkpoint(2)
    del files["engine_rng.safetensors"]
    files["engine_rng.pt"] = buf.getvalue()
    meta = {k: v for k, v in manifest.items() if k not in
            {"step", "run_id", "files", "bytes", "created", "write_s", "key_id", MAC_FIELD}}
    store.save_checkpoint(2, files, meta)
    store.delete(f"{rel}/engine_rng.safetensors")
    engine = victim[1]
    engine.store = store
    with warnings_of("rollart") as records:
        assert engine.restore_rng(2) is False
    msgs = [r.getMessage() for r in records]
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert "engine_rng.pt is a pickle" in msgs[0] and "fresh seed" in msgs[0]
    assert not marker.exists(), "the planted pickle ran"

    files["engine_rng.safetensors"] = pickle.dumps([_Payload(marker)])
    del files["engine_rng.pt"]
    store.save_checkpoint(2, files, meta)
    with warnings_of("rollart.storage") as records:
        assert find_resume_point(store)[0] == 1
    _one_line_refusal(records, "engine_rng.safetensors", "safetensors")
    with pytest.raises(CheckpointRefused, match="engine_rng.safetensors") as info:
        engine.restore_rng(2)
    assert "\n" not in str(info.value)
    assert not marker.exists(), "the planted pickle ran"


def _bad_header(kind: str) -> tuple[str, bytes]:
    if kind == "safetensors":
        data = safetensors.torch.save({"w": torch.ones(4)})
        return "model.safetensors", struct.pack("<Q", 10**9) + data[8:]  # length past the end
    if kind == "json":
        return "ledger.json", b'{"records": [["s0", 0, "cons'
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [1, 2, 3]}), buf)
    data = buf.getvalue()
    return "pending.parquet", data[:-12] + b"\0" * 8 + data[-4:]  # footer length smashed


@pytest.mark.parametrize("kind", ["safetensors", "json", "parquet"])
def test_a_corrupt_header_falls_back_like_a_crc_mismatch(store, kind):
    """Written broken by the owner's own process (so the manifest is authentic and the digests
    match): found when the resume picks its checkpoint, one line, the previous one is used."""
    name, data = _bad_header(kind)
    files, manifest = store.load_checkpoint(2)
    files[name] = data
    meta = {k: v for k, v in manifest.items() if k not in
            {"step", "run_id", "files", "bytes", "created", "write_s", "key_id", MAC_FIELD}}
    store.save_checkpoint(2, files, meta)
    with warnings_of("rollart.storage") as records:
        step, _ = find_resume_point(store)
    assert step == 1
    _one_line_refusal(records, name, "corrupt" if kind != "json" else "not valid JSON")
    with pytest.raises(CheckpointRefused, match=name):
        store.load_checkpoint(2)


def _unsign(store: RunStore, step: int) -> None:
    """A checkpoint as older versions wrote it: CRC32s, no SHA-256, no MAC."""
    manifest = _manifest(store, step)
    for entry in manifest["files"].values():
        entry.pop("sha256")
    manifest.pop(MAC_FIELD)
    manifest.pop("key_id")
    store.write_text(f"checkpoints/{step:08d}/manifest.json", json.dumps(manifest))


def test_unsigned_checkpoints_are_refused_unless_the_owner_accepts_them(store, monkeypatch):
    _unsign(store, 1)
    _unsign(store, 2)
    with pytest.raises(ResumeError, match="ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS=1") as info:
        find_resume_point(store)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS", "1")
    assert find_resume_point(store)[0] == 2  # re-signed with the owner's key
    assert MAC_FIELD in _manifest(store, 2) and MAC_FIELD not in _manifest(store, 1)
    store.load_checkpoint(2)
    # Now the run has a signed checkpoint: an unsigned one is a stripped MAC, never accepted.
    with pytest.raises(CheckpointRefused, match="its MAC was removed"):
        adopt_unsigned(store, 1)


def test_without_the_owners_key_nothing_is_loaded(store, monkeypatch, tmp_path):
    monkeypatch.setenv(secrets.CHECKPOINT_KEY_VAR, ATTACKER_KEY)
    with pytest.raises(ResumeError, match="signed with another checkpoint key"):
        find_resume_point(store)
    monkeypatch.delenv(secrets.CHECKPOINT_KEY_VAR)  # and no key file in the state dir
    with pytest.raises(CheckpointRefused, match="holds no checkpoint key"):
        store.load_checkpoint(1)
    assert store.list_checkpoints() == [1, 2]  # a refused resume deletes nothing


def test_the_key_file_is_private_and_the_cli_hands_it_over(monkeypatch, tmp_path):
    from infra.state import checkpoint_key

    state = tmp_path / "state"
    key = checkpoint_key(state)
    assert key and len(bytes.fromhex(key)) == 32 and checkpoint_key(state) == key
    assert (state.stat().st_mode & 0o777, (state / "checkpoint-key").stat().st_mode & 0o777) == (
        0o700, 0o600)
    monkeypatch.delenv(secrets.CHECKPOINT_KEY_VAR)
    assert secrets.checkpoint_key() == bytes.fromhex(key)  # the library finds the same file
    os.chmod(state / "checkpoint-key", 0o644)
    with pytest.raises(secrets.CheckpointKeyError, match="mode 0600"):
        secrets.checkpoint_key()


def test_evaluation_and_continue_start_from_the_newest_authentic_checkpoint(store):
    """`rollart evaluate` / `continue-run` pick their default checkpoint by its manifest's MAC,
    not by its files being full-size: a forged newest checkpoint is skipped with one line."""
    _forge(store, {"model.safetensors": _zeroed_weights(store)}, "sha256")
    assert store.latest_checkpoint() == 2  # complete: every listed file full-size
    with warnings_of("rollart.storage") as records:
        assert store.latest_authentic_checkpoint() == 1
    _one_line_refusal(records, "manifest.json is not authentic")
