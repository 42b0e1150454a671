"""The run that the integrity tests attack (tests/security/test_checkpoint_integrity.py,
test_run_files.py): the in-process loop (`run_local`: the flow's stages, trainer, engine,
checkpointer and store) run by its owner, who holds the checkpoint key; the attacker holds
another key and can write the store."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rollart import secrets
from rollart.config import RunConfig, load_config
from rollart.runner.local_loop import run_local
from rollart.storage.store import RunStore

CONFIG = str(Path(__file__).parents[2] / "configs" / "default.yaml")
BASE = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "storage.save_every=1", "storage.keep_last=5"]
OWNER_KEY = "0f" * 32
ATTACKER_KEY = "a5" * 32
RUN = "victim"


def owners_config(root: Path | str, iterations: int, *more: str) -> RunConfig:
    return load_config(CONFIG, [*BASE, f"storage.root={root}", f"iterations={iterations}", *more])


def become_owner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process is the run's owner: it holds the key; no state directory key is used."""
    monkeypatch.setenv(secrets.CHECKPOINT_KEY_VAR, OWNER_KEY)
    monkeypatch.setenv("ROLLART_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ROLLART_ACCEPT_UNSIGNED_CHECKPOINTS", raising=False)


def owners_run(root: Path, iterations: int) -> dict[str, Any]:
    """The owner's run under `root`, a checkpoint after every iteration."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(secrets.CHECKPOINT_KEY_VAR, OWNER_KEY)
        return run_local(owners_config(root, iterations), RUN)


def copy_of_store(root: Path, tmp_path: Path) -> RunStore:
    """A fresh copy of the owner's store, for one test to attack."""
    shutil.copytree(root, tmp_path / "store")
    return RunStore(str(tmp_path / "store"), RUN)
