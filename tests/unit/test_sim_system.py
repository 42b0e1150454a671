"""The full-system simulator against hand-computed cases, and it drives the real Router.

Round-number hardware: class "A" does 1 TFLOP/s and 1 GB/s, "B" 0.1 TFLOP/s and 2 GB/s; the
model has 1e9 params at 1 byte each (W = 1 GB), so a prompt token costs 2e9 / 1e12 = 2 ms of
prefill on A and one decode step reads W in 1 s on A (0.5 s on B). Efficiencies are 1.
"""

import pytest

from rollart.config import LatencyConfig
from rollart.routing import HardwareClass, Router
from rollart.sim import EngineModel, EpisodePlan, SimConfig, TaskModel, TrainerModel
from rollart.sim.cluster import (
    EnvModel,
    ModelSpec,
    PoolModel,
    RoutingModel,
    SyncModel,
    SystemConfig,
    TrainModel,
)
from rollart.sim.rewards import RewardModel, RewardPool
from rollart.sim.system import PARTS, SystemSimulation, simulate_system
from rollart.sim.workload import SimConfigError

CATALOG = {"A": HardwareClass(name="A", peak_tflops=1, mem_bw_gbs=1, memory_gb=1),
           "B": HardwareClass(name="B", peak_tflops=0.1, mem_bw_gbs=2, memory_gb=1)}
MODEL = ModelSpec(params=1e9, bytes_per_param=1.0, active_params=None)
ZERO = LatencyConfig()


def pool(hw="A", replicas=1, **kw):
    return PoolModel(hw, replicas, gpus_per_replica=1, prefill_eff=1.0, decode_eff=1.0, **kw)


def system(tasks, pools=(None,), iterations=1, group_size=1, num_groups=1, alpha=0,
           update_s=1.0, sync_s=0.5, **kw):
    sim = SimConfig(tasks=tuple(tasks), engine=EngineModel(overhead_s=1e-9),
                    trainer=TrainerModel(update_s, sync_s), group_size=group_size,
                    num_groups=num_groups, max_staleness=alpha, iterations=iterations,
                    batching="continuous", max_consecutive_failures=0)
    pools = tuple(p or pool() for p in pools)
    return SystemConfig(sim=sim, pools=pools, model=MODEL, catalog=CATALOG, **kw)


def task(name="t", turns=1, prompt=100, obs=50, decode=10.0, **kw):
    return TaskModel(name, turns=(turns, turns), first_prompt_tokens=prompt, obs_tokens=obs,
                     decode_tokens=decode, latency=kw.pop("latency", ZERO), **kw)


def test_one_turn_roofline_call_update_sync():
    # prefill 100 x 2 ms = 0.2 s; decode 10 steps x max(1 s weights, 1 row x 2 ms) = 10 s.
    r = simulate_system(system([task()]))
    assert r.sim.wall_s == pytest.approx(10.2 + 1.0 + 0.5)
    assert r.sim.engine_busy_s == [pytest.approx(10.2)]
    assert r.steps[0]["generation"] == pytest.approx(10.2)
    assert r.steps[0]["step_s"] == pytest.approx(11.7)


def test_roofline_vs_per_row_decode_pricing():
    # Two rows decoding 10 and 20 tokens in one call (no prompt): roofline 10 steps x 1 s with
    # both rows + 10 x 1 s with one = 20 s; per_row (the router's estimate, batch 2):
    # (10 + 20) x W / 2 / bw = 15 s.
    def busy(mode):
        cfg = system([task(prompt=0, decode=10.0)], group_size=2,
                     pools=(pool(max_batch=2, decode=mode, batching="static"),))
        sim = SystemSimulation(cfg, plan=lambda st, rng: EpisodePlan(
            (0.0,), None, (10.0 if st.episode_id.endswith("0") else 20.0,)))
        return sim.run_system().sim.engine_busy_s[0]
    assert busy("roofline") == pytest.approx(20.0)
    assert busy("per_row") == pytest.approx(15.0)


def lengths(*decodes):
    return lambda st, rng: EpisodePlan((0.0,), None, (decodes[int(st.episode_id[-1])],))


def test_continuous_batching_rows_leave_and_join():
    # max_batch 2, three 1-turn episodes decoding 10, 20, 5 tokens, all queued at t = 0 (no
    # prompt): m0 and m1 join (step 1 s: weights-bound) and leave at 10 and 20; m2 joins at 10
    # (a row is free) and leaves at 15. Static batching would hold m0 until 20 and run m2 after.
    cfg = system([task(prompt=0)], pools=(pool(max_batch=2),), group_size=3)
    r = SystemSimulation(cfg, plan=lengths(10.0, 20.0, 5.0)).run_system()
    assert r.steps[0]["generation"] == pytest.approx(20.0)
    assert r.sim.engine_busy_s == [pytest.approx(20.0)]
    static = system([task(prompt=0)], pools=(pool(max_batch=2, batching="static"),),
                    group_size=3)
    rs = SystemSimulation(static, plan=lengths(10.0, 20.0, 5.0)).run_system()
    assert rs.steps[0]["generation"] == pytest.approx(25.0)


def test_continuous_step_is_compute_bound_with_many_rows():
    # On B (0.1 TFLOP/s, 2 GB/s) a step reads W in 0.5 s; 40 rows compute 40 x 2e9 / 1e11 =
    # 0.8 s: compute-bound. 40 rows x 10 tokens: 8 s.
    cfg = system([task(prompt=0)], pools=(pool("B", max_batch=64),), group_size=40)
    assert simulate_system(cfg).sim.engine_busy_s == [pytest.approx(8.0)]


def test_prefix_cache_hit_prefills_only_new_tokens():
    # Two turns on one replica: turn 1 prefills 100; turn 2 the answer + observation (10 + 50)
    # on a hit, the whole context 100 + 60 without the cache. Each turn decodes 10 tokens (10 s).
    def busy(cache):
        r = simulate_system(system([task(turns=2)], routing=RoutingModel(prefix_cache=cache)))
        return r.sim.engine_busy_s[0]
    assert busy(True) == pytest.approx(20 + (100 + 60) * 0.002)
    assert busy(False) == pytest.approx(20 + (100 + 160) * 0.002)


def test_update_from_tokens_and_sync_from_bytes():
    # Tokens of the conversation: 100 + 10 + 50 + 10 = 170; update 8 x 1e9 x 170 / (1 x 1e12 x
    # 0.5) = 2.72 s; sync 0.25 + 1e9 / 1e9 = 1.25 s.
    cfg = system([task(turns=2)], train=TrainModel(gpus=1, hw="A", mfu=0.5),
                 sync=SyncModel(bandwidth_gbs=1.0, latency_s=0.25))
    r = simulate_system(cfg)
    gen = 20 + 160 * 0.002
    assert r.steps[0]["training"] == pytest.approx(2.72)
    assert r.steps[0]["sync"] == pytest.approx(1.25)
    assert r.sim.wall_s == pytest.approx(gen + 2.72 + 1.25)


def test_env_startup_and_reward_on_the_critical_path():
    # Start-up 2 s; one reward worker, 3 s per episode, 2 episodes end together: the batch's
    # rewards are in 6 s after they end.
    env = EnvModel(startup=LatencyConfig(median_s=2.0, sigma=0.0))
    rew = RewardModel(kind="fixed", workers=1, cost=LatencyConfig(median_s=3.0, sigma=0.0))
    r = simulate_system(system([task(decode=1.0, prompt=0)], group_size=2, env=env, reward=rew))
    s = r.steps[0]
    assert s["env_startup"] == pytest.approx(2.0)
    assert s["generation"] == pytest.approx(1.0)
    assert s["reward"] == pytest.approx(6.0)
    assert s["step_s"] == pytest.approx(2 + 1 + 6 + 1.0 + 0.5) == r.sim.wall_s
    assert set(s) == {"step_s", "episode_mix", *PARTS}
    # both episodes: 2 s start-up, 1 s generation, no env time, of a 3 s life
    assert s["episode_mix"] == pytest.approx({"env_startup": 2 / 3, "generation": 1 / 3,
                                              "env_step": 0.0})


def test_env_startup_failures_retry_after_timeout():
    env = EnvModel(startup=LatencyConfig(median_s=1.0, sigma=0.0), startup_fail_prob=0.5,
                   startup_timeout_s=30.0)
    r = simulate_system(system([task(decode=1.0, prompt=0)], group_size=8, env=env))
    fails = r.sim.counters.get("env_startup_failures", 0)
    assert fails > 0
    # the slowest start failed k times: 30 k + 1 s, all on the critical path as env start-up
    assert (r.steps[0]["env_startup"] - 1.0) % 30.0 == pytest.approx(0.0, abs=1e-9)
    assert r.steps[0]["env_startup"] > 30


def test_reward_pool_fixed_and_serverless_by_hand():
    fixed = RewardPool(RewardModel(kind="fixed", workers=2))
    assert [fixed.submit(0.0, 1.0) for _ in range(3)] == [1.0, 1.0, 2.0]
    sl = RewardPool(RewardModel(kind="serverless", workers=2, cold_start_s=0.5, idle_s=2.0))
    assert [sl.submit(0.0, 1.0) for _ in range(3)] == [1.5, 1.5, 2.5]
    assert sl.submit(3.0, 1.0) == 4.0  # warm: idle since 1.5 (and 2.5), under idle_s
    assert sl.submit(10.0, 1.0) == 11.5  # idle > 2 s: reclaimed, cold again
    assert sl.cold_starts == 3 and sl.peak == 2
    with pytest.raises(ValueError, match="time order"):
        sl.submit(9.0, 1.0)


def test_affinity_places_prefill_heavy_on_a_and_decode_heavy_on_b(monkeypatch):
    routed = []
    real = Router.route
    monkeypatch.setattr(Router, "route", lambda self, req: routed.append(
        (req.task, d := real(self, req))) or d)
    tasks = [task("obs", prompt=20000, decode=1.0), task("dec", prompt=10, decode=200.0)]
    cfg = system(tasks, pools=(pool("A"), pool("B")), group_size=4, num_groups=2)
    r = simulate_system(cfg)
    where = {(t, d.hw_class) for t, d in routed}
    assert where == {("obs", "A"), ("dec", "B")}
    rr = simulate_system(system(tasks, pools=(pool("A"), pool("B")), group_size=4,
                                num_groups=2, routing=RoutingModel(policy="round_robin")))
    assert r.sim.wall_s < rr.sim.wall_s


def test_failover_reroutes_lost_turns():
    cfg = system([task(turns=3, prompt=0, decode=5.0)], pools=(pool(replicas=2),),
                 group_size=4, iterations=2)
    sim = SystemSimulation(cfg)
    sim.fail_replica(2.0, 0, down_s=100.0)
    r = sim.run_system()
    assert r.sim.counters["replica_failures"] == 1
    assert r.sim.counters["turns_failed_over"] > 0
    assert r.router["router/failover"] > 0 and r.sim.updates == 2


def test_colocated_engines_pause_during_update():
    # alpha 1 would overlap the next batch's generation with the update; colocated it cannot.
    args = dict(tasks=[task(decode=5.0, prompt=0)], iterations=3, alpha=1, update_s=10.0)
    split = simulate_system(system(**args)).sim.wall_s
    colo = simulate_system(system(**args, colocated=True)).sim.wall_s
    assert colo > split


def test_designs_play_the_same_episodes():
    # Common random numbers: an episode's draws depend on (seed, episode id), not on the order in
    # which a design happens to start episodes.
    t = task(turns=3, decode=5.0, decode_sigma=0.5, latency=LatencyConfig(median_s=1.0))
    plans = {}
    for alpha in (0, 1):
        sim = SystemSimulation(system([t], group_size=2, num_groups=2, alpha=alpha,
                                      iterations=2))
        sim.run_system()
        plans[alpha] = {eid: lf.tokens for eid, lf in sim.life.items()}
    shared = set(plans[0]) & set(plans[1])
    assert len(shared) >= 8 and all(plans[0][e] == plans[1][e] for e in shared)


def test_bad_system_configs_fail_clearly():
    with pytest.raises(SimConfigError, match="not in the hardware catalog"):
        system([task()], pools=(pool("Z"),))
    with pytest.raises(SimConfigError, match="prefill_eff"):
        PoolModel("A", 1, prefill_eff=0.0)
    with pytest.raises(SimConfigError, match="workers"):
        RewardModel(workers=0)
    with pytest.raises(SimConfigError, match="policy"):
        RoutingModel(policy="random")  # type: ignore[arg-type]


def test_sharded_routers_split_replicas_and_episodes():
    cfg = system([task(prompt=0, decode=2.0)], pools=(pool(replicas=4),), group_size=8,
                 routing=RoutingModel(policy="least_loaded", shard_replicas=2))
    sim = SystemSimulation(cfg)
    r = sim.run_system()
    assert len(sim.routers) == 2
    assert [sorted(x.replica_ids()) for x in sim.routers] == [["a-0", "a-2"], ["a-1", "a-3"]]
    assert r.router["router/shards"] == 2 and r.router["router/new"] == 8
    assert all(b > 0 for b in r.sim.engine_busy_s)  # episodes reached both shards


def test_interrupting_sync_reissues_turns_in_flight():
    # alpha 1 admits batches 0 and 1 at t = 0 on one replica (4 rows, 1 s per step): batch 0
    # decodes 10 tokens (done at 10, update to 11), batch 1 decodes 30 (in flight at 11).
    def plan(st, rng):
        return EpisodePlan((0.0,), None, (10.0 if st.group_id.endswith("0") else 30.0,))
    args = dict(tasks=[task(prompt=0)], pools=(pool(max_batch=8),), group_size=2, alpha=1,
                iterations=2, sync_s=0.5)
    wait = SystemSimulation(system(**args), plan).run_system()
    intr = SystemSimulation(system(**args, sync_interrupts=True), plan).run_system()
    # waiting: sync from 11 until the rows end at 30, + 0.5; batch 1 taken at once; update 1 s,
    # sync 0.5 -> 32.0. Interrupting: sync 11 -> 11.5, rows re-run 30 s -> 41.5, + 1 + 0.5.
    assert wait.sim.wall_s == pytest.approx(32.0)
    assert intr.sim.wall_s == pytest.approx(43.0)
    assert intr.sim.counters["turns_interrupted"] == 2
