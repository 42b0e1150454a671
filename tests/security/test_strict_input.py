"""Hostile or broken input: nan/inf numbers, bad `--set` paths, run ids that escape the store,
and a non-finite update. Each is refused in one line (CLI: exit code 2) before anything runs,
or (the update) skipped and counted, never applied to the weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollart.config import AlgoConfig, ConfigError, TrainConfig, check_run_id, load_config
from rollart.run import RunSpec
from rollart.train.trainer import Trainer
from rollart.types import Trajectory

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "default.yaml")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": ""}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("override,expect", [
    ("train.lr=.inf", "finite"),
    ("train.lr=.nan", "finite"),
    ("tasks.0.format_penalty=.nan", "finite"),
    ("hardware.H20.relative_cost=-.inf", "finite"),
    ("tasks.9.max_turns=1", "no list entry"),
    ("tasks.first.max_turns=1", "no list entry"),
    ("iterations.x=1", "not a section"),
    ("train.lr=[", "not valid YAML"),
    ("train.lr", "key.path=value"),
])
def test_bad_overrides_are_one_line_errors(override, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(CONFIG, [override])


def test_cli_set_errors_exit_2_with_one_line():
    for args in (["check-config", "--set", "train.lr=.inf"],
                 ["check-config", "--set", "tasks.9.max_turns=1"],
                 ["train", "--set", "tasks.0.format_penalty=.nan"],
                 ["train", "--run-id", "../../etc/cron.d/x"],
                 ["train", "--resume", ".hidden"],
                 ["submit", "-d", "train", "--set", "train.lr=.nan"],
                 ["submit", "-d", "train", "-p", "run_id=a/b"]):
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "..", "", "x" * 129, "a b",
                                 "run`id", "a\nb", "[x](http://evil)"])
def test_unsafe_run_ids_are_refused(bad, tmp_path):
    with pytest.raises(ConfigError, match="not a valid run id"):
        check_run_id(bad)
    cfg = load_config(CONFIG, [f"storage.root={tmp_path}"])
    with pytest.raises(ConfigError):
        RunSpec(cfg, bad)  # every stage gets its run id through a RunSpec
    assert list(tmp_path.iterdir()) == []  # nothing written in (or outside) the store


def test_safe_run_ids_pass():
    for good in ("frozenlake-tiny-20261130-210000", "a", "A.b_c-1", "x" * 128):
        assert check_run_id(good) == good


def test_config_name_is_a_safe_run_id_prefix():
    with pytest.raises(ConfigError, match="invalid config key 'name'"):
        load_config(CONFIG, ["name=../../tmp/x"])


def _traj(i: int, advantage: float) -> Trajectory:
    t = Trajectory(sample_id=f"s{i}", task="t", env_id="e", group_id="g", seed=i, iteration=0,
                   token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1],
                   behaviour_logprobs=[0.0, 0.0, -2.0, -2.0, -2.0],
                   token_versions=[-1, -1, 0, 0, 0])
    t.advantage = advantage
    return t


def test_a_nonfinite_update_is_skipped_and_counted():
    from rollart.config import TinyModelConfig
    from rollart.models.policy import build_tiny_model
    from rollart.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer(["a b c d e f g"], 64)
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    tr = Trainer(model, AlgoConfig(), TrainConfig(epochs=2), pad_id=0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = tr.update([_traj(0, float("nan")), _traj(1, 1.0)])
    assert metrics["train/nonfinite_skipped"] == 2.0  # both epochs
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    metrics = tr.update([_traj(0, -1.0), _traj(1, 1.0)])  # a finite batch still trains
    assert metrics["train/nonfinite_skipped"] == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
