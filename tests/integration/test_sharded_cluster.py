"""A sharded trainer (`train.world_size` 2) on real components: checkpoints on SeaweedFS resumed
at another world size, and a training run through the Prefect flow on the embedded cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch

from infra.seaweed import start_seaweed

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
KEY, SECRET = "rollart-sharded", "rollart-sharded-secret"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"), access_key=KEY, secret_key=SECRET)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def _params(d: Path) -> dict:
    return safetensors.torch.load_file(str(d / "params.safetensors"))


def test_checkpoint_saved_by_two_ranks_resumes_exactly_on_one_and_three(s3_env, tmp_path):
    """Two ranks save their shards after update 2 into S3 (manifest last) and run update 3;
    one rank, and three, resume from that checkpoint and run update 3 too. Their weights
    equal the straight run's up to one update's float reduction order: the state loaded is
    exact, and one AdamW step differs by at most 2 * 1.003 * lr per element (see
    tests/unit/test_sharded_trainer.py for the bound), here 2e-3 at lr 1e-3."""
    from rollart.train.rank_check import launch

    store = f"s3://{s3_env.bucket}/sharded"
    kw = dict(model="tiny", updates=3, rows=10, lr=1e-3, micro=3, max_len=48, seed=1,
              store=store)
    launch(2, tmp_path / "straight", save_at=2, **kw)
    from rollart.storage.store import RunStore

    run = RunStore(store, "rank-check", storage_options={
        "client_kwargs": {"endpoint_url": s3_env.endpoint_url}})
    manifest = run.read_manifest(2)
    shards = sorted(n for n in manifest["files"] if n.startswith("dcp/"))
    assert len(shards) == 2 and "trainer_state.json" in manifest["files"]
    assert json.loads(run.read_text("checkpoints/00000002/trainer_state.json"))["step"] == 2
    # The checkpoint read as one whole model (an engine serving it): the weights at the save.
    from rollart.train.rank_check import tiny_model
    from rollart.train.sharded_state import full_model_state

    files, _ = run.load_checkpoint(2, only=shards)
    whole = full_model_state(tiny_model(), files)
    at_save = safetensors.torch.load_file(str(tmp_path / "straight" /
                                              "params_at_save.safetensors"))
    assert all(whole[k].equal(v) for k, v in at_save.items())
    straight = _params(tmp_path / "straight")
    for world in (1, 3):
        launch(world, tmp_path / f"resumed{world}", resume_from=2, **kw)
        resumed = _params(tmp_path / f"resumed{world}")
        diff = max((straight[k] - resumed[k]).abs().max().item() for k in straight)
        assert diff <= 2 * 1.003 * 1e-3, (world, diff)


def test_two_rank_trainer_through_the_flow(prefect_api, s3_env, tmp_path):
    """Two trainer ranks on two H800 workers: the run completes, its checkpoint on S3 holds
    both ranks' shards (and no single-rank weights file), and the engine serves the trainer's
    weights."""
    from flows.train import train
    from rollart.storage.store import RunStore

    overrides = [
        "iterations=2", "rollout.num_groups=2", "rollout.group_size=4", "eval.episodes=4",
        "storage.save_every=2", "tasks.0.max_turns=3", "cluster.dashboard=false",
        "train.world_size=2", "cluster.workers.H800=2", "reward.backend=local",
        *s3_env.overrides("flow"),
    ]
    out = train(config=str(REPO / "configs/default.yaml"), overrides=overrides,
                run_id="sharded-itest")
    store = RunStore(f"s3://{s3_env.bucket}/flow", "sharded-itest",
                     storage_options={"client_kwargs": {"endpoint_url": s3_env.endpoint_url}})
    manifest = store.read_manifest(2)
    assert sorted(n for n in manifest["files"] if n.startswith("dcp/")) == [
        "dcp/shard-00001-model-00001-of-00001.safetensors",
        "dcp/shard-00002-model-00001-of-00001.safetensors"]
    assert "model.safetensors" not in manifest["files"]
    # Two ranks, on two distinct trainer-class workers.
    (trainer,) = out["placement"]["trainer_service"]
    assert trainer["resources"].get("H800") and trainer["worker"].startswith("H800")
    assert len(set(trainer["ranks"])) == 2
    assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"],
                                                          rel=1e-6)
    rows = store.read_jsonl("metrics.jsonl")
    assert len(rows) == 2 and all(r["train/sequences"] > 0 for r in rows)
    assert os.environ.get("AWS_ACCESS_KEY_ID") == KEY
