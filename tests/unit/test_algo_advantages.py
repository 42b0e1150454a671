"""Advantage estimators against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rollart.algo import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo,
    get_advantage_estimator,
    grpo,
    register_advantage,
    rloo,
    zero_variance_groups,
)

torch.set_num_threads(1)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0])
GROUPS = ["a", "a", "a", "a", "b", "b", "b"]


def test_grpo_hand_computed():
    # group a: mean 0.5; sample std = sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.5 / 0.577350 = +-0.866025
    # group b: all equal -> exactly 0
    adv = grpo(REWARDS, GROUPS, std_eps=1e-6)
    h = 0.5 / (0.5773502691896258 + 1e-6)
    expected = torch.tensor([h, -h, -h, h, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert abs(adv[0].item() - 0.866025) < 1e-5
    assert (adv[4:] == 0.0).all()
    assert adv.dtype == torch.float32 and adv.shape == (7,)


def test_grpo_uses_sample_not_population_std():
    # population std of [1, 0] would be 0.5 (-> +-1.0); sample std is 0.70711 (-> +-0.70711)
    adv = grpo(torch.tensor([1.0, 0.0]), ["g", "g"], std_eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))


def test_dr_grpo_and_flag():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, normalize_std=False), expected)
    # dr_grpo ignores the flag
    torch.testing.assert_close(dr_grpo(REWARDS, GROUPS, normalize_std=True), expected)


def test_rloo_hand_computed():
    # r=1: others [0, 0, 1] mean 1/3 -> 2/3 ; r=0: others [1, 0, 1] mean 2/3 -> -2/3
    adv = rloo(REWARDS, GROUPS)
    t = 2.0 / 3.0
    torch.testing.assert_close(adv, torch.tensor([t, -t, -t, t, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_size_one_and_constant_groups_are_exactly_zero(name):
    fn = get_advantage_estimator(name)
    # float64 0.1 + 0.1 + 0.1 = 0.30000000000000004, so r - mean is 1.4e-17, not 0, unless the
    # estimator zeroes constant groups explicitly (divided by std + eps that would be ~1e-11)
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0, 3.0, 5.0], dtype=torch.float64)
    adv = fn(rewards, ["c", "c", "c", "solo", "d", "d"], normalize_std=True, std_eps=1e-6)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not torch.isnan(adv).any()
    assert adv[4].item() < 0 < adv[5].item()


def test_tensor_group_ids_and_interleaved_order():
    rewards = torch.tensor([1.0, 2.0, 0.0, 2.0, 0.0, 2.0, 1.0])
    ids = torch.tensor([7, 3, 7, 3, 7, 3, 7])  # group 7: [1, 0, 0, 1]; group 3: [2, 2, 2]
    adv = grpo(rewards, ids)
    h = 0.5 / (0.5773502691896258 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([h, 0.0, -h, 0.0, -h, 0.0, h]))
    assert zero_variance_groups(rewards, ids) == {3}


def test_zero_variance_groups():
    assert zero_variance_groups(REWARDS, GROUPS) == {"b"}
    assert zero_variance_groups(torch.tensor([1.0, 2.0, 3.0]), ["x", "y", "y"]) == {"x"}


def test_registry():
    assert {"grpo", "dr_grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS)
    assert get_advantage_estimator("grpo") is grpo
    with pytest.raises(KeyError) as err:
        get_advantage_estimator("ppo_gae")
    assert "grpo" in str(err.value) and "rloo" in str(err.value) and "dr_grpo" in str(err.value)
    with pytest.raises(ValueError):
        register_advantage("grpo")(grpo)


def test_input_validation():
    with pytest.raises(ValueError, match="group ids"):
        grpo(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError, match="NaN"):
        grpo(torch.tensor([1.0, float("nan")]), ["a", "a"])


def test_dtype_preserved_and_int_rewards():
    adv = grpo(torch.tensor([1.0, 0.0], dtype=torch.float64), ["a", "a"])
    assert adv.dtype == torch.float64
    adv = dr_grpo(torch.tensor([1, 0]), ["a", "a"])
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))
