"""The within-group independence test of benchmarks/agentic_sampler_check.py against hand
counts: equal pairs within groups and over all pairs, and the permutation p-value of an
arrangement whose probability is known, of groups that share their answer and of independent
draws; and the pairing of one position across consecutive generate calls."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.agentic_sampler_check import (  # noqa: E402
    group_collisions,
    same_position_pairs,
)


def test_counts_and_pvalue_by_hand() -> None:
    # groups (a, a), (b, b): both within-group pairs equal; over all 6 pairs, 2 are equal. Of
    # the 3 ways to pair four answers, one pairs equal with equal: a shuffle reaches 2 equal
    # pairs with probability 1/3 (sd of the estimate over 3,000 shuffles: 0.009).
    got = group_collisions([[1], [1], [2], [2]], group=2, perms=3000, seed=0)
    assert (got["groups"], got["pairs"], got["equal_pairs"]) == (2, 2, 2)
    assert got["equal_pair_rate"] == 1.0
    assert got["equal_pair_rate_all_pairs"] == pytest.approx(2 / 6)
    assert got["pvalue"] == pytest.approx(1 / 3, abs=0.05)
    # a trailing partial group is left out: five answers in groups of two count four
    assert group_collisions([[1], [1], [2], [2], [1]], 2, 10, 0)["groups"] == 2


def test_groups_that_share_an_answer_fail_and_independent_draws_pass() -> None:
    rng = random.Random(7)
    # 50 groups of 4, each group one answer out of 10: every within-group pair is equal, a
    # shuffle almost never comes close, so p is 1 / (1 + perms)
    shared = [[v] for v in (rng.randrange(10) for _ in range(50)) for _ in range(4)]
    bad = group_collisions(shared, 4, 500, 1)
    assert bad["equal_pair_rate"] == 1.0
    assert bad["pvalue"] == pytest.approx(1 / 501)
    # 200 independent draws from the same 10 answers: within-group pairs are as often equal
    # as any pair (~1/10)
    free = [[rng.randrange(10)] for _ in range(200)]
    good = group_collisions(free, 4, 500, 1)
    assert good["pvalue"] > 0.01
    assert good["equal_pair_rate_all_pairs"] == pytest.approx(0.1, abs=0.03)


def test_same_position_pairs() -> None:
    # calls of 2: [0, 1] [2, 3] [4, 5] [6, 7] [8]: calls 0 and 1, then 2 and 3, position by
    # position; the odd call out and the partial one are left out
    got = same_position_pairs([[k] for k in range(9)], call=2)
    assert got == [[0], [2], [1], [3], [4], [6], [5], [7]]
    # a stream that restarts with every call repeats each position: every pair is equal
    repeated = [[k % 4] for k in range(32)]
    res = group_collisions(same_position_pairs(repeated, 4), 2, 200, 0)
    assert res["equal_pair_rate"] == 1.0
    assert res["pvalue"] == pytest.approx(1 / 201)


def test_pooled_later_turns_by_hand() -> None:
    """Stouffer's z over two seeds: (1 - 3) / sqrt 2; the rare draws summed."""
    from benchmarks.agentic_sampler_check import pooled

    def doc(z: float, obs: int, exp: float) -> dict:
        return {"rollart_vllm": {"later_turns": {
            "surprise_z": z, "rare_draws": {"observed": obs, "expected": exp}}}}

    got = pooled([doc(1.0, 3, 2.5), doc(-3.0, 7, 4.0)])
    assert got["seeds"] == 2
    assert got["later_surprise_z"] == pytest.approx(-2 / 2 ** 0.5)
    assert got["later_surprise_pvalue"] == pytest.approx(0.1573, abs=1e-4)  # 2 P(Z > 1.414)
    assert (got["rare_draws_observed"], got["rare_draws_expected"]) == (10, 6.5)
