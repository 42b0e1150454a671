"""Validation first: the simulator predicts our committed, measured benchmarks within 15 %.

Reads results/async_vs_sync.json, results/affinity.json and results/reward_elastic.json as
committed (see rollart/sim/validate.py for the fields each check reads and what it assumes).
"""

import copy
import json
from pathlib import Path

import pytest

from rollart.sim.validate import (
    FIDELITY_LIMIT,
    TOLERANCE,
    benchmark_order,
    validate_affinity,
    validate_async,
    validate_rewards,
)

RESULTS = Path(__file__).resolve().parents[2] / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def aff() -> dict:
    """The affinity check of the committed file (one run for all tests: ~0.4 s)."""
    return validate_affinity(load("affinity"))


def test_async_vs_sync_walls_within_tolerance():
    v = validate_async(load("async_vs_sync"), seeds=8)
    assert set(v["variants"]) == {"sync", "async1", "async2"}
    for name, r in v["variants"].items():
        assert r["error"] <= TOLERANCE, (name, r)
    # the simulator also gets the direction: asynchrony shortens the run
    p = {k: r["predicted_wall_s"] for k, r in v["variants"].items()}
    assert p["sync"] > 1.5 * p["async1"]


def test_reward_elastic_makespans_within_tolerance():
    v = validate_rewards(load("reward_elastic"))
    assert 0 < v["cold_start_s"] < 1
    for mode, r in v["modes"].items():
        assert r["error"] <= TOLERANCE, (mode, r)
    m = v["modes"]
    assert m["fixed"]["predicted_makespan_s"] > 8 * m["elastic"]["predicted_makespan_s"]


def test_affinity_round_robin_wall_within_tolerance_and_scored(aff):
    v = aff
    assert v["instrument"], v.get("why_not")
    rr = v["policies"]["round_robin"]
    # the simulated router takes the measured decisions in every repeat, so the wall is scored
    assert rr["scored"] and all(rr["same_decisions_runs"])
    assert rr["error"] <= TOLERANCE, rr
    assert max(rr["error_runs"]) <= TOLERANCE, rr["error_runs"]
    assert "round_robin_wall" in v["scored"]


def test_affinity_simulation_reproduces_the_repeats_whose_decisions_it_reproduces(aff):
    """Where the simulated router decides as the measured one did (same seed), the replicas'
    modelled busy time agrees to the ms and the wall within a few %: only the harness's host
    overhead (tens of ms per run) is missing."""
    v = aff
    matched = 0
    for policy, r in v["policies"].items():
        for i, same in enumerate(r["same_decisions_runs"]):
            if not same:
                continue
            matched += 1
            assert r["predicted_placed_runs"][i] == r["measured_placed_runs"][i], (policy, i)
            for rid, busy in r["predicted_busy_s_runs"][i].items():
                assert busy == pytest.approx(r["measured_modelled_s_runs"][i][rid], abs=0.002)
            assert r["error_runs"][i] <= 0.05, (policy, i, r["error_runs"][i])
    assert matched >= 8  # of 10 (5 repeats x 2 policies)
    # and the affinity policy's placements follow the classes: prefill-heavy on the H800
    placed = v["policies"]["affinity"]["predicted_placed_runs"][0]
    assert placed["obs/H800"] > placed["obs/H20"] and placed["reason/H20"] > placed["reason/H800"]


def test_affinity_wall_and_speedup_within_tolerance(aff):
    v = aff
    if "speedup" not in v["scored"]:
        # as committed: the benchmark's router decided differently in two repeats (noise the
        # simulator does not model) and the medians miss by more than 15 %; the message names
        # the measured and predicted numbers (validate.py: not_scored_why)
        assert v["errors"]["affinity_wall"] > TOLERANCE or v["speedup_error"] > TOLERANCE
        pytest.xfail("affinity wall and speedup not predictable within 15 %: "
                     + v["not_scored_why"])
    assert v["errors"]["affinity_wall"] <= TOLERANCE and v["speedup_error"] <= TOLERANCE


def test_affinity_replay_with_measured_overhead_explains_the_rest(aff):
    """Shown, not scored: with each repeat's measured host overhead per batch (busy - modelled)
    the simulated router takes the measured decisions in every repeat and every wall is within
    5 %: the unscored affinity repeats were decided by that overhead, not by the cost model."""
    r = aff["replay"]
    for policy, p in r["policies"].items():
        assert all(p["same_decisions_runs"]), policy
        assert max(p["error_runs"]) <= 0.05, (policy, p["error_runs"])
    assert r["speedup_error"] <= 0.05


def test_affinity_validation_scores_only_what_it_reproduces(aff):
    m, v = load("affinity"), aff
    assert v["scored_error"] == max(v["errors"][k] for k in v["scored"])
    assert v["max_error"] == max(v["errors"].values())
    # a file whose walls are the simulation's own times 1.05 is predicted with error 1 - 1/1.05
    good = copy.deepcopy(m)
    for policy, r in v["policies"].items():
        good["policies"][policy]["wall_s_runs"] = [x * 1.05 for x in r["predicted_wall_s_runs"]]
    g = validate_affinity(good, explain=False)
    assert g["policies"]["round_robin"]["error"] == pytest.approx(1 - 1 / 1.05)
    # the decisions, not the errors, decide what is scored
    assert g["scored"] == v["scored"]
    # a replica busy far beyond its modelled time: not an instrument
    slow = copy.deepcopy(m)
    for run in slow["policies"]["round_robin"]["runs"]:
        for rep in run["replicas"].values():
            rep["busy_s"] = rep["modelled_s"] * (FIDELITY_LIMIT + 0.5)
    assert not validate_affinity(slow, explain=False)["instrument"]
    # the pre-issue-21 layout (no modelled emulation) is reported, not scored
    old = {k: v for k, v in m.items() if k != "emulation"}
    o = validate_affinity(old)
    assert not o["instrument"] and o["max_error"] is None


def test_benchmark_order_is_the_benchmarks_shuffle():
    order = benchmark_order(0, 12, ["obs", "reason"])
    assert sorted(order) == ["obs"] * 12 + ["reason"] * 12
    assert "".join(t[0] for t in order) == "rorooorrooororororrroorr"


def test_affinity_branch_is_a_race_that_the_measured_host_overhead_decides(aff):
    """Why the affinity wall is not scored: in each repeat the simulated decisions change once a
    few ms of host time per batch are added to one replica (the H800 ends its 5th batch 32 ms
    before the H20 ends its 2nd), and the repeats whose measured host overhead reached that
    threshold are exactly the ones whose measured decisions differ from the simulated ones."""
    r = aff["race"]["affinity"]
    assert all(r["explained_runs"]), r
    h800 = [t["h800-0"] for t in r["flip_overhead_s_runs"]]
    assert all(t is not None and 0.002 < t < 0.025 for t in h800), h800
    assert any(r["crossed_runs"]) and not all(r["crossed_runs"])
    # round robin's repeats are all reproduced: no race to explain
    assert "round_robin" not in aff["race"]


def test_affinity_at_time_scale_10_is_predicted_in_every_repeat():
    """`benchmarks/affinity.py --time-scale 10` (results/affinity_ts10.json): batches ten times
    longer, so the race the time-scale-1 run loses to ms of host time has a ~320 ms margin. The
    simulated router takes the measured decisions in every repeat of both policies, and every
    wall, the medians and the speedup are within the tolerance."""
    v = validate_affinity(load("affinity_ts10"))
    assert v["instrument"], v.get("why_not")
    assert set(v["scored"]) == {"affinity_wall", "round_robin_wall", "speedup"}
    for policy in ("affinity", "round_robin"):
        r = v["policies"][policy]
        assert all(r["same_decisions_runs"]), policy
        assert max(r["error_runs"]) <= TOLERANCE, (policy, r["error_runs"])
    assert v["max_error"] <= TOLERANCE and v["speedup_error"] <= TOLERANCE
    # and affinity routing pays on it: round robin / affinity well above 1
    assert load("affinity_ts10")["speedup_vs_round_robin_min"] > 1.3


def test_validation_scores_the_time_scale_10_affinity_file_and_reports_the_other():
    from rollart.sim.validate import validate_all

    val = validate_all(RESULTS, seeds=8)
    assert val["affinity"]["file"].endswith("affinity_ts10.json")
    assert val["max_error_all"] <= TOLERANCE, {k: v["max_error"] for k, v in val.items()
                                               if isinstance(v, dict)}
    ts1 = val["affinity_time_scale_1"]
    assert not ts1["instrument"] and ts1["max_error"] > val["max_error_all"]
