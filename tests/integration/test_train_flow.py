"""The `train` flow for 2 iterations on a real local Dask cluster with hardware-class workers,
reporting to a real Prefect server."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

pytestmark = pytest.mark.integration


def test_flow_two_iterations_on_hardware_class_workers(prefect_api, tmp_path):
    from flows.train import train
    from rollart.config import load_config
    from rollart.models.policy import build_tiny_model
    from rollart.models.run_model import load_run_tokenizer
    from rollart.storage.store import RunStore

    overrides = [
        "iterations=2", "rollout.num_groups=2", "rollout.group_size=4", "eval.episodes=4",
        "storage.save_every=2", f"storage.root={tmp_path}", "tasks.0.max_turns=3",
    ]
    out = train(config="configs/default.yaml", overrides=overrides, run_id="itest")
    store = RunStore(str(tmp_path), "itest")

    # A complete checkpoint with its manifest.
    assert store.latest_checkpoint() == 2
    manifest = json.loads(store.read_text("checkpoints/00000002/manifest.json"))
    assert {"model.safetensors", "optimizer.safetensors", "rng.json"} <= set(manifest["files"])
    assert Path(out["checkpoint"]).name == "00000002"

    # Parameters changed: checkpoint weights differ from the seeded initial weights.
    cfg = load_config("configs/default.yaml", overrides)
    init = build_tiny_model(cfg.model.tiny, load_run_tokenizer(store), cfg.seed)
    saved = safetensors.torch.load(store.read_bytes("checkpoints/00000002/model.safetensors"))
    changed = [k for k, v in saved.items() if not torch.equal(v, init.state_dict()[k])]
    assert changed, "no parameter changed after two updates"
    # The engine serves the trainer's latest weights.
    assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"])

    # Each stage ran on a worker of the class it was mapped to.
    expected = {
        "prepare": "CPU", "collect": "CPU", "evaluate": "CPU", "score": "CPU",
        "update": "H800", "checkpoint": "H800", "trainer_service": "H800",
        "sync_weights": "H20", "engine_service": "H20",
    }
    placement = out["placement"]
    for stage, hw in expected.items():
        assert placement.get(stage), f"stage {stage} never reported"
        for rec in placement[stage]:
            assert hw in rec["resources"], f"{stage} ran on {rec}"
            assert rec["worker"].startswith(hw)

    # Metrics were written per iteration, namespaced.
    rows = store.read_jsonl("metrics.jsonl")
    assert len(rows) == 2
    for key in ("rollout/success_rate", "reward/mean", "train/pg_loss", "perf/rollout_s",
                "perf/update_s", "rollout/model_tokens"):
        assert key in rows[0]
    assert len(store.read_shards(0)) == 8



def test_flow_with_the_asyncio_runner_over_dask_actors(prefect_api, tmp_path):
    """`rollout.runner: asyncio` in a real run: episodes as tasks on the rollout service's
    loop, the engine replicas and env host Dask actors called through its thread pool, turns
    routed per turn across two replicas, one batch kept running while the update trains. The
    service runs as two shards (`rollout.shards: 2`), one on each of two env-class workers:
    each owns one group of every batch; the stages see one rollout handle."""
    from flows.train import train
    from rollart.config import load_config
    from rollart.storage.checkpointing import audit_ledger
    from rollart.storage.ledger import SampleLedger
    from rollart.storage.store import RunStore

    overrides = [
        "iterations=3", "rollout.num_groups=2", "rollout.group_size=4", "eval.episodes=0",
        "storage.save_every=3", f"storage.root={tmp_path}", "tasks.0.max_turns=3",
        "rollout.runner=asyncio", "rollout.batching=continuous", "rollout.max_staleness=1",
        "engine.replicas=2", "reward.backend=local", "rollout.shards=2",
        "cluster.workers={H800: 1, H20: 1, CPU: 2}",
    ]
    out = train(config="configs/default.yaml", overrides=overrides, run_id="aio")
    shards = out["placement"]["rollout_shard"]
    assert len(shards) == 2 and len({s["worker"] for s in shards}) == 2, shards
    store = RunStore(str(tmp_path), "aio")
    assert store.latest_checkpoint() == 3
    files, manifest = store.load_checkpoint(3, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    audit = audit_ledger(ledger, load_config("configs/default.yaml", overrides), 3)
    assert audit.ok and manifest["ledger"]["ok"], audit.as_dict()
    assert len(ledger.ids("consumed")) == 3 * 8 == len(set(ledger.ids("consumed")))
    rows = store.read_jsonl("metrics.jsonl")
    assert len(rows) == 3
    # Turns were placed by the affinity router (continuous batching, two replicas).
    placed = {k: v for k, v in rows[-1].items() if k.startswith("rollout/router/")
              and "/turns_on/" in k}
    assert sum(placed.values()) > 0, rows[-1]
    assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "train.lrr=1"], "unknown config key 'train.lrr'"),
        (["--set", "rollout.group_size=many"], "rollout.group_size"),
        (["--config", "missing.yaml"], "config file not found"),
    ],
)
def test_bad_config_fails_before_anything_starts(tmp_path, args, fragment):
    env = {"PATH": "/usr/bin:/bin", "ROLLART_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "train", *args], cwd=Path(__file__).parents[2],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not (tmp_path / "state").exists()  # no Prefect server was started
