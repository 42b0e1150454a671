import json

import pytest

from rollart.rewards.client import LocalRewardClient
from rollart.rewards.handlers import env_outcome, get_handler
from rollart.storage.store import RunStore
from rollart.types import Trajectory, Turn


def _traj(i: int, **kw) -> Trajectory:
    turn = Turn(0, "obs", "<answer>Left</answer>", "Left", True, 0.0, 10, 3, 0, 0.1, 0.01)
    return Trajectory(
        sample_id=f"s{i}", task="frozenlake", env_id="FrozenLake-v1", group_id="g", seed=i,
        iteration=0, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behaviour_logprobs=[0, -1, -2],
        token_versions=[-1, 0, 0], turns=[turn], reward=1.0, reward_details={"success": 1.0},
        timings={"env_s": 0.5}, **kw,
    )


def test_shard_roundtrip(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    trajs = [_traj(i, env_return=float(i)) for i in range(3)]
    store.write_shard(4, trajs)
    back = store.read_shards(4)
    assert [t.sample_id for t in back] == ["s0", "s1", "s2"]
    assert back[2].env_return == 2.0 and back[0].turns[0].action == "Left"
    assert back[0].reward_details == {"success": 1.0}
    assert back[0].behaviour_logprobs == [0.0, -1.0, -2.0]


def test_checkpoint_manifest_last_and_torn_ignored(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    store.save_checkpoint(1, {"a.bin": b"x" * 10}, {"note": "first"})
    store.save_checkpoint(2, {"a.bin": b"y" * 10}, {})
    # A torn checkpoint: files but no manifest, and one whose file is shorter than listed.
    store.write_bytes("checkpoints/00000003/a.bin", b"z")
    store.save_checkpoint(4, {"a.bin": b"w" * 10}, {})
    store.write_bytes("checkpoints/00000004/a.bin", b"w")  # truncated after the manifest
    assert store.list_checkpoints() == [1, 2]
    assert store.latest_checkpoint() == 2
    files, manifest = store.load_checkpoint(1)
    assert files == {"a.bin": b"x" * 10} and manifest["note"] == "first"
    removed = store.prune_checkpoints(keep_last=1)
    assert removed == [1]
    assert store.list_checkpoints() == [2]


def test_metrics_jsonl_append(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    store.append_jsonl("metrics.jsonl", {"a": 1})
    store.append_jsonl("metrics.jsonl", {"a": 2})
    assert [r["a"] for r in store.read_jsonl("metrics.jsonl")] == [1, 2]
    assert json.loads(store.read_text("metrics.jsonl").splitlines()[0]) == {"a": 1}


def test_env_outcome_averages_format_penalty_over_turns():
    # 4 turns with penalties -0.1, -0.05, 0, 0 (sum -0.15), goal reached: 1 - 0.15/4
    out = env_outcome({"task_return": 1.0, "format_penalty": -0.15, "num_turns": 4,
                       "success": True}, None)
    assert out["reward"] == pytest.approx(0.9625)
    assert out["format"] == pytest.approx(-0.0375)
    # Length invariance: the same per-turn behaviour over 8 turns gives the same reward.
    short = env_outcome({"task_return": 0.0, "format_penalty": -0.2, "num_turns": 2}, None)
    long = env_outcome({"task_return": 0.0, "format_penalty": -0.8, "num_turns": 8}, None)
    assert short["reward"] == pytest.approx(long["reward"]) == pytest.approx(-0.1)


def test_local_client_scores_and_unknown_handler():
    t = _traj(0, task_return=1.0, format_penalty=0.0, success=True)
    LocalRewardClient("success").score([t])
    assert t.reward == 1.0 and "reward_s" in t.timings
    with pytest.raises(KeyError, match="known"):
        get_handler("nope")
