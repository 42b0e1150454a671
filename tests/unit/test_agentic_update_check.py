"""The statistics of benchmarks/agentic_update_check.py, against hand-computed values: the
Kolmogorov-Smirnov distance, the randomized probability integral transform (uniform for an
exact sampler, far from it for a biased one), the rare draws and the gap between a sampler's
reported and the exact log-probs, the turn prompts taken from stored episodes, and
the relative weight difference."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import agentic_update_check  # noqa: E402
from benchmarks.agentic_update_check import (  # noqa: E402
    calibration,
    ks_uniform,
    pit_values,
    rel_diff,
    surprise_terms,
    turn_prompts,
)
from rollart.types import SamplingParams, Trajectory  # noqa: E402


def test_ks_distance_by_hand() -> None:
    # sorted 0.1, 0.4, 0.7: max over i of (i+1)/n - x_i and x_i - i/n: 1 - 0.7 = 0.3
    d, p = ks_uniform([0.7, 0.1, 0.4])
    assert d == pytest.approx(0.3)
    assert 0.0 <= p <= 1.0
    # 400 points evenly spread over [0, a]: D = 1 - a (n - 0.5) / n at the top. With
    # (sqrt(n) + 0.12 + 0.11 / sqrt(n)) D = 1.3581, the Kolmogorov table's 5 % critical value,
    # the p-value is 0.05.
    n = 400
    d_target = 1.3581 / (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n))
    a = (1 - d_target) * n / (n - 0.5)
    d, p = ks_uniform([a * (i + 0.5) / n for i in range(n)])
    assert d == pytest.approx(d_target)
    assert p == pytest.approx(0.05, abs=5e-4)


def test_pit_by_hand() -> None:
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.4, 0.0]], dtype=torch.float64)
    u = pit_values(probs, torch.tensor([1, 0]), torch.tensor([0.5, 0.25], dtype=torch.float64))
    # row 0: P(<1) = 0.2, + 0.5 * 0.5; row 1: 0 + 0.25 * 0.6
    assert u.tolist() == pytest.approx([0.45, 0.15])


def test_surprise_terms_by_hand() -> None:
    # a fair coin: every draw's surprise is the entropy, variance 0
    assert surprise_terms(torch.tensor([[0.5, 0.5]], dtype=torch.float64),
                          torch.tensor([1])) == pytest.approx((0.0, 0.0), abs=1e-15)
    # P = (0.25, 0.75, 0), outcome 0: log 0.25 + H; variance E[(log p)^2] - H^2
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    var = 0.25 * math.log(0.25) ** 2 + 0.75 * math.log(0.75) ** 2 - h * h
    got = surprise_terms(torch.tensor([[0.25, 0.75, 0.0]], dtype=torch.float64),
                         torch.tensor([0]))
    assert got == pytest.approx((math.log(0.25) + h, var))


def _draws(probs: torch.Tensor, sampled_from: torch.Tensor, seed: int
           ) -> tuple[list[float], float]:
    """(integral transforms, surprise z) of one draw per row of `sampled_from`, judged
    against `probs`."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.multinomial(sampled_from, 1, generator=gen)[:, 0]
    noise = torch.rand(len(slots), generator=gen, dtype=torch.float64)
    score, var = surprise_terms(probs, slots)
    return pit_values(probs, slots, noise).tolist(), score / math.sqrt(var)


def test_an_exact_sampler_passes_and_a_sharper_one_fails() -> None:
    gen = torch.Generator().manual_seed(12345)  # not the draws' stream (seed 1)
    # 20,000 positions, each its own categorical over 6 outcomes (as a policy's turns are)
    probs = torch.softmax(torch.randn(20000, 6, generator=gen, dtype=torch.float64) * 2, -1)
    # exact draws: under the null each statistic is this far out once in a thousand seeds
    us, z = _draws(probs, probs, 1)
    assert ks_uniform(us)[1] > 1e-3 and abs(z) < 3.3
    # a sampler at temperature 0.9 instead of 1 (sharper): the surprise shows it (z ~ 12 > 0:
    # the draws are likelier than the policy's own); the KS distance alone barely would
    sharper = torch.softmax(torch.log(probs) / 0.9, -1)
    assert _draws(probs, sharper, 1)[1] > 6


def _traj(ids: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(sample_id="s", task="guess", env_id="guess", group_id="g", seed=0,
                      iteration=0, token_ids=ids, loss_mask=mask,
                      behaviour_logprobs=[0.0] * len(ids), token_versions=[0] * len(ids))


def test_turn_prompts_are_each_conversation_up_to_each_generated_turn() -> None:
    a = _traj([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 0])  # turns start at 2 and 5
    b = _traj([1, 2, 9, 9], [0, 0, 1, 1])  # same opening as a: one prompt
    assert turn_prompts([[a], [b]], 10) == [[1, 2], [1, 2, 3, 4, 5]]
    assert turn_prompts([[a, b]], 1) == [[1, 2]]


def test_rel_diff_is_relative_to_the_change() -> None:
    base = {"w": torch.zeros(2)}
    b = {"w": torch.tensor([3.0, 4.0])}  # moved by 5
    a = {"w": torch.tensor([3.0, 4.5])}  # 0.5 away from b
    assert rel_diff(a, b, base) == pytest.approx(0.1)
    assert rel_diff(a, b) == pytest.approx(0.1)  # |b| is 5 too


def test_rare_draws_and_reported_gap_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt, two answers over a bag of three tokens (ids 5, 7, 9), the exact rows given."""
    tiny = math.exp(agentic_update_check.RARE_LOGP) / 2  # below the rare threshold
    rows = [torch.tensor([[1 - 2 * tiny, tiny, tiny], [0.5, 0.5, 0.0]], dtype=torch.float64),
            torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)]
    monkeypatch.setattr(agentic_update_check, "answer_probs", lambda *a: rows)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, allowed_token_ids=[9, 5, 7])
    answers = [[[7, 5], [9]]]  # a rare draw (7 at P = tiny), then P 0.5; then P 0.5
    told = [[[math.log(tiny) + 0.25, math.log(0.5)], [math.log(0.5) - 0.1]]]
    got = calibration(torch.nn.Identity(), [[1, 2]], answers, params, seed=0, reported=told)
    # rare: one observed; expected = mass below the threshold over the three rows = 2 * tiny
    assert got["rare_draws"]["observed"] == 1
    assert got["rare_draws"]["expected"] == pytest.approx(2 * tiny)
    assert got["reported_logprob_max_gap"] == pytest.approx(0.25)
    assert got["tokens"] == 3 and got["tokens_outside_bag"] == 0
    assert "reported_logprob_max_gap" not in calibration(
        torch.nn.Identity(), [[1, 2]], answers, params, seed=0)
