"""The simulator against hand-computed timelines, and the scheduler it drives is the real one.

Deterministic workload used below: N = group_size x num_groups = 2 x 2 = 4 episodes per batch,
3 turns each, env step 0.5 s, a generate call over k turns 0.1 + 0.01 k s, sync 0.25 s.
"""

import random
import subprocess
import sys

import pytest

import rollart.rollout.scheduler as scheduler_mod
from rollart.config import LatencyConfig
from rollart.rollout.scheduler import RolloutScheduler, Start
from rollart.sim import (
    EngineModel,
    EpisodePlan,
    SimConfig,
    SimConfigError,
    Simulation,
    TaskModel,
    TrainerModel,
    sample_plan,
    simulate,
)

FIXED = LatencyConfig(median_s=0.5, sigma=0.0)


def det(alpha: int = 0, update_s: float = 1.0, iterations: int = 5, **kw) -> SimConfig:
    args = {"group_size": 2, "num_groups": 2, "max_staleness": alpha, "iterations": iterations,
            "batching": "continuous", "max_consecutive_failures": 0}
    args.update(kw)
    return SimConfig(tasks=(TaskModel("t", turns=(3, 3), latency=FIXED),),
                     engine=EngineModel(overhead_s=0.1, per_request_s=0.01),
                     trainer=TrainerModel(update_s=update_s, sync_s=0.25), **args)


def test_alpha0_wall_is_iterations_times_rollout_update_sync():
    r = simulate(det(alpha=0, update_s=1.0, iterations=5))
    rollout = 3 * (0.1 + 4 * 0.01 + 0.5)  # 3 turns, all 4 episodes in each call: 1.92 s
    assert r.wall_s == pytest.approx(5 * (rollout + 1.0 + 0.25), abs=1e-9)  # 15.85
    assert r.wait_s == pytest.approx([rollout] * 5, abs=1e-9)
    assert r.engine_calls == [15]
    assert r.engine_busy_s[0] == pytest.approx(5 * 3 * 0.14)
    assert r.trainer_idle_frac == pytest.approx(1 - 5.0 / 15.85)
    assert r.staleness == [[0, 0]] * 5
    assert r.updates == 5 and not r.halted


@pytest.mark.parametrize("batching", ["continuous", "lockstep"])
def test_alpha0_same_with_lockstep_when_episodes_are_alike(batching):
    assert simulate(det(batching=batching)).wall_s == pytest.approx(15.85, abs=1e-9)


def test_alpha1_overlaps_rollout_with_update():
    # max_staleness 1 admits two batches at t = 0 (8 episodes share each call): 3 x 0.68 s.
    # After that one batch starts at each sync and finishes (1.92 s) within the next update
    # (3 s), so the trainer never waits again: wall = first rollout + 5 x (update + sync).
    r = simulate(det(alpha=1, update_s=3.0, iterations=5))
    first = 3 * (0.1 + 8 * 0.01 + 0.5)
    assert r.wall_s == pytest.approx(first + 5 * (3.0 + 0.25), abs=1e-9)  # 18.29
    assert r.wait_s == pytest.approx([first, 0, 0, 0, 0], abs=1e-9)
    assert r.staleness == [[0, 0]] + [[1, 1]] * 4
    # Batches: two at t = 0, then one per sync for updates 2, 3, 4; none wasted at the end.
    assert r.engine_busy_s[0] == pytest.approx(3 * 0.18 + 3 * 3 * 0.14)
    assert r.counters["groups_started"] == 10 and r.counters["groups_consumed"] == 10


def test_alpha2_three_batches_up_front():
    r = simulate(det(alpha=2, update_s=3.0, iterations=5))
    assert r.wall_s == pytest.approx(3 * (0.1 + 12 * 0.01 + 0.5) + 5 * 3.25, abs=1e-9)
    assert r.staleness == [[0, 0], [1, 1], [2, 2], [2, 2], [2, 2]]


def test_two_engines_split_each_turn():
    # 4 turns arrive together, routed 2 + 2: each call 0.1 + 2 x 0.01.
    r = simulate(det(engines=2))
    assert r.wall_s == pytest.approx(5 * (3 * (0.12 + 0.5) + 1.25), abs=1e-9)
    assert r.engine_calls == [15, 15]


def test_sync_waits_for_the_call_in_progress():
    # Slow calls: 0.1 + k x 1.0 s; 1 turn; alpha 1; 3 updates; update 0.05 s, sync 0.25 s.
    cfg = SimConfig(tasks=(TaskModel("t", turns=(1, 1), latency=FIXED),),
                    engine=EngineModel(overhead_s=0.1, per_request_s=1.0),
                    trainer=TrainerModel(update_s=0.05, sync_s=0.25),
                    group_size=2, num_groups=2, max_staleness=1, iterations=3,
                    batching="continuous", max_consecutive_failures=0)
    r = simulate(cfg)
    # Batches 0, 1 (8 turns) in one call: done at 8.1 + 0.5 = 8.6. Update 0 to 8.65, sync to
    # 8.9; batch 2 starts (call 8.9 -> 13.0) and batch 1 is taken at once: update to 8.95,
    # then the sync waits for the call: 13.0 + 0.25. Batch 2 finishes at 13.5: update, sync.
    assert r.wait_s == pytest.approx([8.6, 0.0, 13.5 - 13.25], abs=1e-9)
    assert r.wall_s == pytest.approx(13.5 + 0.05 + 0.25, abs=1e-9)


def plan_with(slow: set[str] = frozenset(), fail: set[str] = frozenset(), turns: int = 1):
    def plan(st: Start, rng: random.Random) -> EpisodePlan:
        step = 10.0 if st.episode_id in slow else 0.5
        return EpisodePlan((step,) * turns, 0 if st.episode_id in fail else None)
    return plan


def test_redundancy_keeps_first_finishers_and_cancels_the_slow_member():
    cfg = det(update_s=1.0, iterations=1, num_groups=1, redundancy=1)
    r = simulate(cfg, plan_with(slow={"g0/m0"}))
    assert r.batches == [{"g0": ["g0/m1", "g0/m2"]}]
    assert r.counters["cancelled_redundant"] == 1
    # 3 episodes, 1 turn: call 0.13 s, env 0.5 s; the slow member (10 s) does not count.
    assert r.wall_s == pytest.approx(0.13 + 0.5 + 1.25, abs=1e-9)


def test_failure_is_reissued_and_counted():
    cfg = det(update_s=1.0, iterations=1, num_groups=1, max_retries=1)
    r = simulate(cfg, plan_with(fail={"g0/m0"}))
    assert r.counters["failed"] == 1 == r.counters["injected_failures"]
    assert r.counters["retried"] == 1
    assert r.batches == [{"g0": ["g0/m1", "g0/m2"]}]  # m2 is the re-issue
    # 0.12 call + 0.5 env: m0 fails, m2 starts at 0.62: 0.11 call + 0.5 env -> 1.23.
    assert r.wall_s == pytest.approx(1.23 + 1.25, abs=1e-9)


def test_random_failures_match_scheduler_counters():
    task = TaskModel("t", turns=(1, 4), fail_prob=0.1, latency=LatencyConfig(median_s=0.1))
    cfg = SimConfig(tasks=(task,), engine=EngineModel(0.05, 0.001),
                    trainer=TrainerModel(0.5, 0.1), group_size=4, num_groups=3,
                    max_staleness=1, max_retries=1, iterations=20, seed=3,
                    batching="continuous", max_consecutive_failures=0)
    r = simulate(cfg)
    c = r.counters
    assert c["injected_failures"] == c["failed"] > 10
    assert 0 < c["retried"] <= c["failed"]
    assert c["groups_consumed"] == 60 and r.updates == 20


def test_all_failing_halts_like_the_service():
    task = TaskModel("t", fail_prob=0.999, latency=FIXED)
    cfg = SimConfig(tasks=(task,), engine=EngineModel(0.1), trainer=TrainerModel(1.0),
                    group_size=2, num_groups=1, max_consecutive_failures=5, iterations=3,
                    batching="continuous")
    r = simulate(cfg)
    assert r.halted and r.updates == 0 and r.counters["failed"] == 5


HEAVY = LatencyConfig(median_s=0.02, sigma=0.5, tail_prob=0.05, tail_s=0.4, tail_alpha=1.5)


def heavy(alpha: int, seed: int = 0, batching: str = "continuous") -> SimConfig:
    tasks = (TaskModel("lake", turns=(1, 8)), TaskModel("slow", turns=(1, 8), latency=HEAVY))
    return SimConfig(tasks=tasks, engine=EngineModel(0.015, 0.0008),
                     trainer=TrainerModel(0.4, 0.08), group_size=8, num_groups=4,
                     max_staleness=alpha, iterations=30, batching=batching, seed=seed,
                     max_consecutive_failures=0)


@pytest.mark.parametrize("alpha", [0, 1, 2])
def test_staleness_never_exceeds_bound(alpha):
    r = simulate(heavy(alpha))
    assert max(max(s) for s in r.staleness) == alpha  # reached, never exceeded
    assert all(len(b) == 4 for b in r.batches) and r.counters["groups_consumed"] == 120
    assert 0 <= r.trainer_idle_frac <= 1 and 0 <= r.engine_idle_frac <= 1


def test_asynchrony_shortens_heavy_tailed_run():
    walls = [simulate(heavy(a)).wall_s for a in (0, 1, 2)]
    assert walls[0] > walls[1] > walls[2]


def test_same_seed_same_result_other_seed_differs():
    a, b = simulate(heavy(1, seed=7)), simulate(heavy(1, seed=7))
    assert a.to_dict() == b.to_dict()
    assert simulate(heavy(1, seed=8)).wall_s != a.wall_s


def test_bad_configs_fail_clearly():
    with pytest.raises(SimConfigError, match="group_size"):
        det(group_size=0)
    with pytest.raises(SimConfigError, match="turns"):
        TaskModel("t", turns=(3, 1))
    with pytest.raises(SimConfigError, match="sum to 1"):
        TaskModel("t", turn_probs=(0.5, 0.2))
    with pytest.raises(SimConfigError, match="fail_prob"):
        TaskModel("t", fail_prob=1.0)
    with pytest.raises(SimConfigError, match="batching"):
        det(batching="eager")
    with pytest.raises(SimConfigError, match="gets 0 of num_groups"):
        SimConfig(tasks=(TaskModel("a"), TaskModel("b")), engine=EngineModel(0.1),
                  trainer=TrainerModel(1.0), num_groups=1)
    with pytest.raises(SimConfigError, match="must take time"):
        EngineModel()


def test_drives_the_real_scheduler(monkeypatch):
    sim = Simulation(det(iterations=2))
    assert type(sim.sched) is RolloutScheduler is scheduler_mod.RolloutScheduler
    calls = []
    real = RolloutScheduler.take_batch
    monkeypatch.setattr(RolloutScheduler, "take_batch",
                        lambda self, u: calls.append(u) or real(self, u))
    assert simulate(det(iterations=2)).updates == 2
    assert calls and set(calls) == {0, 1}


def test_turns_and_latency_sampling():
    rng = random.Random(0)
    task = TaskModel("t", turn_probs=(0.0, 1.0))
    assert {sample_plan(task, rng).step_s.__len__() for _ in range(20)} == {2}
    task = TaskModel("t", turns=(1, 8), latency=HEAVY)
    plans = [sample_plan(task, rng) for _ in range(2000)]
    assert {len(p.step_s) for p in plans} == set(range(1, 9))
    steps = sorted(s for p in plans for s in p.step_s)
    assert steps[len(steps) // 2] == pytest.approx(0.02, rel=0.15)  # lognormal median (+tail)


def test_latency_env_samples_the_same_formula():
    from rollart.envs.wrappers import LatencyEnv

    env = LatencyEnv(None, HEAVY)
    env.rng = random.Random(5)
    rng = random.Random(5)
    assert [env.delay() for _ in range(500)] == [HEAVY.sample(rng) for _ in range(500)]


def test_import_is_light():
    code = ("import sys, rollart.sim; bad = [m for m in ('torch', 'dask', 'distributed', "
            "'prefect') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
