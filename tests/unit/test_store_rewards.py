import pytest

from rollart.rewards.client import LocalRewardClient
from rollart.rewards.handlers import env_outcome
from rollart.rewards.registry import get_handler


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


def test_local_client_scores_and_unknown_handler(make_traj):
    t = make_traj(0, task_return=1.0, format_penalty=0.0, success=True)
    LocalRewardClient("success").score([t])
    assert t.reward == 1.0 and "reward_s" in t.timings
    with pytest.raises(KeyError, match="known"):
        get_handler("nope")
