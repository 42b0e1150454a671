"""Tampered checkpoints: whoever can write the store must not run code on `--resume`.

A checkpoint is written through the store (files plus a signed manifest: as its owner would,
or an attacker who got the key), with a pickle that creates a marker file when unpickled. The
store refuses the file before any loader sees it (its header: rollart/storage/formats.py), the
loader refuses it on its own too, resuming refuses the checkpoint with a clear one-line error,
and the marker never exists. (A forger without the key: tests/security/
test_checkpoint_integrity.py.)
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from rollart.config import AlgoConfig, TrainConfig, load_config
from rollart.storage.integrity import CheckpointRefused
from rollart.storage.resume import ResumeError
from rollart.storage.store import RunStore
from rollart.train.state_io import UnsafeCheckpointError
from rollart.train.trainer import Trainer

CONFIG = str(Path(__file__).parents[2] / "configs" / "default.yaml")
BASE = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "storage.save_every=1", "iterations=1"]


class _Payload:
    """Unpickling this calls Path.touch(marker): code execution, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _evil_pickle(marker: Path) -> bytes:
    return pickle.dumps({"torch": _Payload(marker)})


def _evil_torch_file(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "x": _Payload(marker)}, buf)
    return buf.getvalue()


def _trainer() -> Trainer:
    torch.manual_seed(0)
    return Trainer(torch.nn.Linear(4, 3), AlgoConfig(), TrainConfig())


def _stepped_trainer() -> Trainer:
    tr = _trainer()
    tr.model(torch.randn(2, 4)).sum().backward()
    tr.optimizer.step()
    return tr


@pytest.mark.parametrize("attack", ["legacy rng.pt", "pickle as rng.safetensors",
                                    "pickle as rng.json", "legacy optimizer.pt",
                                    "pickle as optimizer.safetensors"])
def test_planted_pickle_is_never_unpickled(tmp_path, attack):
    marker = tmp_path / "PWNED"
    files = _stepped_trainer().checkpoint_files()
    if attack == "legacy rng.pt":  # the checkpoint layout of older versions
        del files["rng.json"], files["rng.safetensors"]
        files["rng.pt"] = _evil_torch_file(marker)
    elif attack == "pickle as rng.safetensors":
        files["rng.safetensors"] = _evil_pickle(marker)
    elif attack == "pickle as rng.json":
        files["rng.json"] = _evil_pickle(marker)
    elif attack == "legacy optimizer.pt":
        del files["optimizer.json"], files["optimizer.safetensors"]
        files["optimizer.pt"] = _evil_torch_file(marker)
    else:
        files["optimizer.safetensors"] = _evil_pickle(marker)
    store = RunStore(str(tmp_path / "store"), "victim")
    store.save_checkpoint(2, files, {"iteration": 1})
    with pytest.raises(CheckpointRefused, match="pickle|not valid JSON|safetensors"):
        store.load_checkpoint(2)  # authentic and intact, but not a loadable file
    with pytest.raises(UnsafeCheckpointError) as info:  # the loader, handed it directly
        _trainer().load_checkpoint_files(files)
    assert not marker.exists(), "the planted pickle ran"
    assert "pickle" in str(info.value) or "malformed" in str(info.value) or \
        "not a plain tensor file" in str(info.value)


def test_the_safe_formats_round_trip_exactly():
    tr = _stepped_trainer()
    files = tr.checkpoint_files()
    assert not {"optimizer.pt", "rng.pt"} & set(files)
    for name in ("rng.safetensors", "optimizer.safetensors"):
        assert files[name][:1] != b"\x80", f"{name} is a pickle"  # protocol header
    fresh = _trainer()
    fresh.load_checkpoint_files(files)
    assert fresh.checkpoint_files() == files
    draws = []
    for seed in (1, 2):  # disturb the global RNGs, then restore them from the checkpoint
        torch.manual_seed(seed)
        fresh.load_checkpoint_files(files)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])


def test_resume_refuses_a_tampered_checkpoint(tmp_path):
    """The real resume path (the in-process loop): the RNG state of the only checkpoint is
    swapped for a pickle (and the manifest signed again); `resume` refuses it in one line
    naming the file and runs nothing from it."""
    from rollart.runner.local_loop import run_local

    marker = tmp_path / "PWNED"
    root = f"storage.root={tmp_path / 'store'}"
    run_local(load_config(CONFIG, [*BASE, root]), "victim")
    store = RunStore(str(tmp_path / "store"), "victim")
    step = store.latest_checkpoint()
    files, manifest = store.load_checkpoint(step)
    del files["rng.json"], files["rng.safetensors"]
    files["rng.pt"] = _evil_torch_file(marker)
    meta = {k: v for k, v in manifest.items()
            if k not in {"step", "run_id", "files", "bytes", "created", "write_s"}}
    store.save_checkpoint(step, files, meta)
    with pytest.raises(ResumeError, match="rng.pt is a pickle") as info:
        run_local(load_config(CONFIG, [*BASE, root, "iterations=2"]), "victim", resume=True)
    assert "\n" not in str(info.value)
    assert not marker.exists()
