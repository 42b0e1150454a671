"""Hardware-affinity routing: catalog, cost model, task profiles, router policies, config."""

import pytest

from rollart.config import ConfigError, load_config
from rollart.routing import (
    DEFAULT_CATALOG,
    CostModel,
    NoHealthyReplica,
    ReplicaSpec,
    Router,
    RouteRequest,
    TaskProfiles,
    emulation_slowdowns,
)

H800, H20 = DEFAULT_CATALOG["H800"], DEFAULT_CATALOG["H20"]
# 1B parameters in bf16, no batching: 2e9 FLOPs per prefill token, 2e9 bytes per decode token.
COST = CostModel.for_model(1e9, bytes_per_param=2.0, decode_batch=1)

PREFILL_HEAVY = dict(task="sokoban", new_tokens=4000, decode_tokens=10)
DECODE_HEAVY = dict(task="arith", new_tokens=100, decode_tokens=1000)


def req(rid: str, episode: str, **kw) -> RouteRequest:
    return RouteRequest(request_id=rid, episode_id=episode, **kw)


def hetero(**kw) -> Router:
    return Router([ReplicaSpec("h800", H800), ReplicaSpec("h20", H20)], COST, **kw)


def twins(**kw) -> Router:
    return Router([ReplicaSpec("a", H800), ReplicaSpec("b", H800)], COST, **kw)


# ---------------------------------------------------------------- catalog and cost model


def test_catalog_figures_and_derived_emulation_factors():
    assert (H800.peak_tflops, H800.mem_bw_gbs, H800.memory_gb) == (989, 3350, 80)
    assert (H20.peak_tflops, H20.mem_bw_gbs, H20.memory_gb) == (148, 4000, 96)
    assert DEFAULT_CATALOG["H200"].mem_bw_gbs == 4800 and DEFAULT_CATALOG["CPU"].kind == "cpu"
    assert H800.flops == 989e12 and H20.bandwidth == 4000e9 and H20.dask_resource == "H20"
    f = emulation_slowdowns([H800, H20])
    assert f["H800"].prefill == 1.0 and f["H800"].decode == pytest.approx(4000 / 3350)
    assert f["H20"].prefill == pytest.approx(989 / 148) and f["H20"].decode == 1.0


def test_service_times_hand_computed():
    # prefill-heavy: 4000 x 2e9 / 989e12 + 10 x 2e9 / 3.35e12 = 8.0890 ms + 5.9701 ms
    assert COST.service_s(H800, 4000, 10) == pytest.approx(0.0080890 + 0.0059701, rel=1e-4)
    # on H20: 4000 x 2e9 / 148e12 + 10 x 2e9 / 4e12 = 54.054 ms + 5 ms
    assert COST.service_s(H20, 4000, 10) == pytest.approx(0.054054 + 0.005, rel=1e-4)
    # decode-heavy on H800: 100 x 2e9 / 989e12 + 1000 x 2e9 / 3.35e12 = 0.2022 + 597.01 ms
    assert COST.service_s(H800, 100, 1000) == pytest.approx(0.00020222 + 0.59701, rel=1e-4)
    # on H20: 1.3514 ms + 500 ms
    assert COST.service_s(H20, 100, 1000) == pytest.approx(0.0013514 + 0.5, rel=1e-4)
    # batching amortises the weight read: 8 rows share one step's 2 GB
    assert CostModel.for_model(1e9, 2.0, decode_batch=8).bytes_per_token == 0.25e9


# ---------------------------------------------------------------- must-show


def test_prefill_heavy_goes_to_compute_pool_decode_heavy_to_bandwidth_pool_when_idle():
    r = hetero()
    d = r.route(req("p", "e1", **PREFILL_HEAVY))
    assert (d.replica_id, d.hw_class, d.reason) == ("h800", "H800", "new")
    assert d.est_service_s == pytest.approx(COST.service_s(H800, 4000, 10))
    r2 = hetero()  # both idle again
    d = r2.route(req("d", "e2", **DECODE_HEAVY))
    assert (d.replica_id, d.hw_class) == ("h20", "H20")
    assert d.est_service_s == pytest.approx(0.5013514, rel=1e-4)


def test_mixed_arrivals_split_by_affinity():
    r = hetero()
    assert r.route(req("p", "e1", **PREFILL_HEAVY)).replica_id == "h800"
    # h800 now waits 14 ms: 14 + 597 ms there vs 501 ms on h20
    d = r.route(req("d", "e2", **DECODE_HEAVY))
    assert d.replica_id == "h20" and d.est_wait_s == 0.0


def test_stickiness_holds_across_turns_below_the_threshold():
    r = twins(imbalance_threshold_s=1.0, prefix_cache=True)
    first = r.route(req("t1", "ep", task="x", new_tokens=1000, decode_tokens=100))
    assert first.replica_id == "a"  # tie: first replica
    r.on_finished("t1")
    # another episode puts ~0.6 s of work on "a"; "b" is idle, but 0.6 s < 1 s threshold
    r.route(req("other", "ep2", task="x", new_tokens=0, decode_tokens=1000))
    assert r.wait_s("a") == pytest.approx(0.597, rel=1e-2) and r.wait_s("b") == 0.0
    for turn in (2, 3):
        d = r.route(req(f"t{turn}", "ep", task="x", new_tokens=50, context_tokens=1100 * turn,
                        decode_tokens=100))
        assert (d.replica_id, d.reason) == ("a", "sticky")
        # the cached prefix is free on the home replica, a miss elsewhere
        assert d.est_service_s == pytest.approx(COST.service_s(H800, 50, 100))
        assert r.service_s(req("q", "ep", task="x", new_tokens=50, context_tokens=1100 * turn,
                               decode_tokens=100), "b") > d.est_service_s
        r.on_finished(f"t{turn}")
    assert r.metrics()["router/sticky"] == 2


def test_overload_spills_to_the_idle_replica():
    r = twins(imbalance_threshold_s=1.0)
    assert r.route(req("t1", "ep", task="x", new_tokens=100, decode_tokens=10)).replica_id == "a"
    r.on_finished("t1")
    for i in range(2):  # a sticky hog puts 2 x 0.597 s on "a": imbalance 1.19 s > 1 s
        assert r.route(req(f"o{i}", "hog", task="x", decode_tokens=1000, new_tokens=0)
                       ).replica_id == "a"
    assert r.wait_s("a") == pytest.approx(1.194, rel=1e-3) and r.wait_s("b") == 0.0
    d = r.route(req("t2", "ep", task="x", new_tokens=100, decode_tokens=10))
    assert (d.replica_id, d.reason) == ("b", "spill")
    assert r.home("ep") == "b"  # the episode's prefix now lives on b
    assert r.metrics()["router/spill"] == 1


def test_affinity_spill_keeps_the_home_when_it_still_finishes_first():
    # a prefill-heavy episode on a loaded H800: H20 would take 6.7x longer to prefill, so the
    # re-decision keeps it on the H800 even though the imbalance passes the threshold
    r = hetero(imbalance_threshold_s=0.01)
    r.route(req("t1", "ep", **PREFILL_HEAVY))
    r.on_finished("t1")
    r.route(req("load", "ep2", task="x", new_tokens=6000, decode_tokens=0))  # 12 ms on h800
    assert r.wait_s("h800") > 0.01
    big = dict(PREFILL_HEAVY, new_tokens=40_000)  # 81 ms on h800 vs 541 ms on h20
    d = r.route(req("t2", "ep", **big))
    assert (d.replica_id, d.reason) == ("h800", "sticky")


def test_failed_pool_is_avoided_and_recovers():
    r = hetero()
    d = r.route(req("p1", "e1", **PREFILL_HEAVY))
    assert d.replica_id == "h800"
    lost = r.on_failed("h800")
    assert lost == ["p1"] and r.wait_s("h800") == 0.0 and r.healthy() == ["h20"]
    # the lost request is re-issued: it fails over to the healthy pool
    d = r.route(req("p1", "e1", **PREFILL_HEAVY))
    assert (d.replica_id, d.reason) == ("h20", "failover")
    # a new prefill-heavy episode also avoids the failed compute pool
    assert r.route(req("p2", "e2", **PREFILL_HEAVY)).replica_id == "h20"
    r.on_finished("p1")
    r.on_finished("p2")
    r.on_recovered("h800")
    assert r.route(req("p3", "e3", **PREFILL_HEAVY)).replica_id == "h800"
    r.on_failed("h800")
    r.on_failed("h20")
    with pytest.raises(NoHealthyReplica):
        r.route(req("p4", "e4", **PREFILL_HEAVY))


# ---------------------------------------------------------------- baselines and bookkeeping


def test_round_robin_rotates_and_skips_failed():
    r = Router([ReplicaSpec(i, H800) for i in "abc"], COST, policy="round_robin")
    got = [r.route(req(f"r{i}", f"e{i}", task="x", new_tokens=1)).replica_id for i in range(4)]
    assert got == ["a", "b", "c", "a"]
    r.on_failed("b")
    got = [r.route(req(f"s{i}", f"f{i}", task="x", new_tokens=1)).replica_id for i in range(3)]
    assert "b" not in got


def test_least_loaded_counts_outstanding_requests_class_blind():
    r = hetero(policy="least_loaded")
    assert r.route(req("d1", "e1", **DECODE_HEAVY)).replica_id == "h800"  # tie: first
    assert r.route(req("p1", "e2", **PREFILL_HEAVY)).replica_id == "h20"  # class-blind
    r.on_finished("d1")
    assert r.route(req("d2", "e3", **DECODE_HEAVY)).replica_id == "h800"


def test_episode_end_forgets_the_home_and_bad_inputs_raise():
    r = twins()
    r.route(req("t1", "ep", task="x", new_tokens=10))
    with pytest.raises(ValueError, match="already routed"):
        r.route(req("t1", "ep", task="x", new_tokens=10))
    r.on_finished("t1")
    r.on_episode_end("ep")
    assert r.home("ep") is None and r.wait_s("a") == 0.0
    with pytest.raises(ValueError, match="policy"):
        twins(policy="random")


# ---------------------------------------------------------------- task profiles


def test_task_profile_ema_prior_and_metrics():
    p = TaskProfiles(alpha=0.5, prior_decode_tokens=64)
    assert p.expected_decode_tokens("arith") == 64  # unseen: the prior
    p.observe_turn("arith", new_prompt_tokens=20, decode_tokens=200)  # first sample sets it
    p.observe_turn("arith", new_prompt_tokens=40, decode_tokens=100)
    p.observe_env_step("arith", 0.2)
    p.observe_turn("sokoban", new_prompt_tokens=900, decode_tokens=12)
    assert p.expected_decode_tokens("arith") == 150
    assert p.expected_new_prompt_tokens("arith") == 30
    m = p.metrics()
    assert m["rollout/profile/arith/decode_tokens"] == 150
    assert m["rollout/profile/arith/env_step_s"] == pytest.approx(0.2)
    assert m["rollout/profile/arith/turns"] == 2
    assert m["rollout/profile/sokoban/prefill_decode_ratio"] == 75
    with pytest.raises(ValueError):
        TaskProfiles(alpha=0)


# ---------------------------------------------------------------- config


def test_config_defaults_keep_one_engine_pool_on_h20():
    cfg = load_config("configs/default.yaml")
    assert cfg.cluster.engine_classes(cfg.engine.replicas) == ["H20"]
    assert cfg.routing.policy == "affinity" and not cfg.routing.emulation.enabled
    assert cfg.hardware["H800"] == H800


def test_config_engine_pools_hardware_merge_and_router():
    from rollart.routing.setup import build_router, emulation_factors, engine_replicas

    cfg = load_config("configs/default.yaml", [
        "cluster.engine_pools={H800: 1, H20: 2}", "hardware.H20.relative_cost=0.5",
        "hardware.B200={peak_tflops: 2250, mem_bw_gbs: 8000, memory_gb: 180}",
        "routing.emulation.enabled=true", "routing.emulation.mode=slowdown",
        "routing.emulation.factors={H20: {prefill: 5}}"])
    assert cfg.cluster.engine_classes() == ["H800", "H20", "H20"]
    assert cfg.hardware["H20"].relative_cost == 0.5 and cfg.hardware["H20"].peak_tflops == 148
    assert cfg.hardware["B200"].name == "B200"
    assert [s.hw.name for s in engine_replicas(cfg)] == ["H800", "H20", "H20"]
    f = emulation_factors(cfg)
    assert f["H20"].prefill == 5 and f["H800"].decode == pytest.approx(4000 / 3350)
    router = build_router(cfg, params=1e6)
    assert router.replica_ids() == ["engine-0", "engine-1", "engine-2"]
    assert not router.prefix_cache  # HF engine re-prefills


@pytest.mark.parametrize("overrides, fragment", [
    (["cluster.engine_pools={H800: 0}"], "engine_pools must map each class to >= 1"),
    (["cluster.engine_pools={TPU: 1}"], "engine_pools names classes ['TPU']"),
    (["cluster.engine_pools={H800: 1}", "engine.replicas=2"], "not both"),
    (["cluster.engine_pools={X: 1}", "cluster.workers.X=1"], "add hardware.X"),
    (["routing.policy=random"], "'routing.policy'"),
    (["routing.emulation.factors={H20: {decode: 0.5}}"], "greater than or equal to 1"),
    (["routing.emulation.mode=slowdown", "routing.emulation.factors={Z: {prefill: 2}}"],
     "not in hardware"),
    (["routing.emulation.factors={H20: {prefill: 2}}"], "apply to mode: slowdown only"),
    (["routing.emulation.time_scale=0"], "'routing.emulation.time_scale'"),
    (["routing.correction_bound=0.5"], "'routing.correction_bound'"),
    (["hardware.H20.name=H800"], "must equal its key"),
])
def test_bad_affinity_config_is_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_online_correction_scales_estimates_from_measured_batches():
    r = twins()
    assert r.correction_bound == 2.0  # one class: replicas may differ by up to 2^2
    da = r.route(req("a1", "e1", task="x", new_tokens=0, decode_tokens=1000))  # 0.597 s raw
    db = r.route(req("b1", "e2", task="x", new_tokens=0, decode_tokens=1000))
    assert (da.replica_id, db.replica_id) == ("a", "b")
    r.on_batch("a", ["a1"], busy_s=3 * da.est_service_s)  # a ran 3x slower than estimated
    m = r.metrics()
    # one replica measured: the common part is its ratio, and the unmeasured one shares it
    # (it must not look 3x faster just because it has not reported yet)
    assert m["router/scale/a"] == pytest.approx(3.0) and m["router/scale/b"] == pytest.approx(3.0)
    r.on_batch("b", ["b1"], busy_s=db.est_service_s)  # b as estimated
    for i in ("a1", "b1"):
        r.on_finished(i)
    m = r.metrics()
    # common g = sqrt(3 x 1); relative 3 / g = 1.732 and 1 / g = 0.577, inside [1/2, 2]
    assert m["router/correction/common"] == pytest.approx(3 ** 0.5)
    assert m["router/scale/a"] == pytest.approx(3.0) and m["router/scale/b"] == pytest.approx(1.0)
    again = req("a2", "e3", task="x", new_tokens=0, decode_tokens=1000)
    assert r.service_s(again, "a") == pytest.approx(3 * r.service_s(again, "b"))
    # ... so the next request prefers the replica that is really faster
    assert r.route(again).replica_id == "b"


def _teach(r: Router, ratios: dict[str, float]) -> None:
    """Report one finished batch per replica whose measured time is `ratio` x its estimate."""
    for rid, ratio in ratios.items():
        work = PREFILL_HEAVY if rid == "h800" else DECODE_HEAVY  # lands on rid when idle
        d = r.route(req(f"teach-{rid}-{r.metrics()['router/new']}", f"teach-{rid}", **work))
        assert d.replica_id == rid
        r.on_batch(rid, [d.request_id], ratio * d.est_service_s / r.metrics()[
            f"router/scale/{rid}"])
        r.on_finished(d.request_id)
        r.on_episode_end(f"teach-{rid}")


def test_bounded_correction_cannot_reverse_the_class_cost_model():
    """Default catalog, 1B bf16 model, idle pools. Hand-computed service times:
    prefill-heavy (4000 prefill + 10 decode tokens): H800 14.059 ms, H20 59.054 ms (4.20x);
    decode-heavy (100 + 1000): H800 597.21 ms, H20 501.35 ms (H20 1.191x faster).
    Bound b = (4000 / 3350) ** 0.25 = 1.04533: relative correction at most b^2 = 1.0927 < 1.191."""
    b = (4000 / 3350) ** 0.25
    assert hetero().correction_bound == pytest.approx(b) == pytest.approx(1.04533, rel=1e-5)
    for ratios in ({"h800": 0.1, "h20": 10.0}, {"h800": 10.0, "h20": 0.1},
                   {"h800": 1e3, "h20": 1e-3}, {"h800": 1e-3, "h20": 1e3}):
        r = hetero()
        for _ in range(5):  # repeated contended batches, the EMA converges to the ratios
            _teach(r, ratios)
        m = r.metrics()
        g = (ratios["h800"] * ratios["h20"]) ** 0.5
        assert m["router/correction/common"] == pytest.approx(g)
        hi, lo = ("h20", "h800") if ratios["h20"] > ratios["h800"] else ("h800", "h20")
        assert m[f"router/scale/{hi}"] == pytest.approx(g * b)  # clamped at the bound
        assert m[f"router/scale/{lo}"] == pytest.approx(g / b)
        p = r.route(req("p", "ep", **PREFILL_HEAVY))
        d = r.route(req("d", "ed", **DECODE_HEAVY))
        assert (p.replica_id, p.hw_class) == ("h800", "H800"), ratios
        assert (d.replica_id, d.hw_class) == ("h20", "H20"), ratios
        # worst case for the decode-heavy turn (H20 penalised): H20 at g x b, 501.35 ms x 1.04533
        # = 524.08 ms x g, against the H800 at g / b, 597.21 ms / 1.04533 = 571.31 ms x g
        if hi == "h20":
            assert d.est_service_s / g == pytest.approx(0.52408, rel=1e-4)
            assert r.service_s(req("q", "eq", **DECODE_HEAVY), "h800") / g == pytest.approx(
                0.57131, rel=1e-4)


def test_unbounded_correction_would_reverse_it():
    """The same contended measurements without the bound (the old per-replica scalar): the H20
    looks 10 / 0.1 = 100x slower and takes neither turn, against the hardware."""
    r = hetero(correction_bound=1e6)
    _teach(r, {"h800": 0.1, "h20": 10.0})
    assert r.route(req("d", "ed", **DECODE_HEAVY)).replica_id == "h800"


def test_host_matched_slowdowns_keep_the_gpu_cost_ratios():
    from rollart.routing import emulated_class, host_matched_slowdowns

    cost = CostModel.for_model(1e6, 2.0, decode_batch=8)
    s = host_matched_slowdowns([H800, H20], cost.flops_per_token, cost.bytes_per_token,
                               host_prefill_s=50e-6, host_decode_s=250e-6)
    assert min(s["H800"].prefill, s["H800"].decode, s["H20"].prefill, s["H20"].decode) == 1.0
    assert s["H20"].prefill / s["H800"].prefill == pytest.approx(989 / 148)
    assert s["H800"].decode / s["H20"].decode == pytest.approx(4000 / 3350)
    # emulated per-token decode / prefill time on H800 equals the GPU's: (989/3.35) / 8 = 36.9
    emu = {c.name: emulated_class(c, cost.flops_per_token, cost.bytes_per_token, 50e-6, 250e-6,
                                  s[c.name]) for c in (H800, H20)}
    assert (cost.service_s(emu["H800"], 0, 1) / cost.service_s(emu["H800"], 1, 0)
            == pytest.approx(989 / 3.35 / 8))
    assert cost.service_s(emu["H800"], 1, 0) == pytest.approx(50e-6 * s["H800"].prefill)


# ---------------------------------------------------------------- batching (issue 21)

# 1B bf16 with 8 rows per engine batch: a decode step reads 2 GB once for the whole batch.
BATCHED = CostModel.for_model(1e9, bytes_per_param=2.0, decode_batch=8)


def test_batch_cost_is_the_longest_row_at_a_full_step_hand_computed():
    # H800, 8 rows: 4 x (1000 prefill, 8 decode) + 4 x (16, 128):
    # prefill (4000 + 64) x 2e9 / 989e12 = 8.2184 ms; decode 128 x 2e9 / 3.35e12 = 76.418 ms
    rows = [(1000, 8)] * 4 + [(16, 128)] * 4
    assert BATCHED.batch_s(H800, rows) == pytest.approx(8.2184e-3 + 76.418e-3, rel=1e-4)
    # the same rows split by task: 2 batches, 8.0890 + 4.7761 ms and 0.1294 + 76.418 ms
    assert (BATCHED.batch_s(H800, [(1000, 8)] * 4) + BATCHED.batch_s(H800, [(16, 128)] * 4)
            == pytest.approx(12.865e-3 + 76.547e-3, rel=1e-4))
    # a full batch of equal rows costs the sum of the per-request shares
    assert BATCHED.batch_s(H20, [(16, 128)] * 8) == pytest.approx(
        8 * BATCHED.service_s(H20, 16, 128))
    # 9 rows: a second batch
    assert BATCHED.batch_s(H20, [(0, 128)] * 9) == pytest.approx(2 * 128 * 2e9 / 4e12)


def test_affinity_batches_like_with_like():
    """A decode-heavy turn arrives while the H800 holds 3 queued prefill-heavy turns and the H20
    one running batch of 8 decode-heavy turns (on_started). Hand-computed (1B bf16, batch 8):
    - H800: wait 3 x 1000 x 2e9 / 989e12 + 8 x 2e9 / 3.35e12 = 6.0667 + 4.7761 = 10.843 ms;
      joining that batch stretches its decode from 8 to 128 steps: +120 x 0.59701 ms + 0.032 ms
      prefill = 71.674 ms, inflicted on the 3 queued rows too: cost 10.843 + 4 x 71.674 =
      297.54 ms (earliest finish alone: 10.843 + 71.674 = 82.52 ms);
    - H20: wait 128 x 2e9 / 4e12 + 8 x 16 x 2e9 / 148e12 = 64 + 1.7297 = 65.730 ms (the running
      batch takes no new rows); a new batch for it: 64.216 ms; cost 129.95 ms.
    Earliest finish alone would pick the H800 (82.52 < 129.95); affinity picks the H20."""
    r = Router([ReplicaSpec("h800", H800), ReplicaSpec("h20", H20)], BATCHED)
    for i in range(3):
        assert r.route(req(f"p{i}", f"p{i}", task="obs", new_tokens=1000, decode_tokens=8)
                       ).replica_id == "h800"
    for i in range(8):
        assert r.route(req(f"d{i}", f"d{i}", task="reason", new_tokens=16, decode_tokens=128)
                       ).replica_id == "h20"
    r.on_started("h20", [f"d{i}" for i in range(8)])
    assert r.wait_s("h800") == pytest.approx(10.843e-3, rel=1e-4)
    assert r.wait_s("h20") == pytest.approx(65.730e-3, rel=1e-4)
    new = req("d8", "d8", task="reason", new_tokens=16, decode_tokens=128)
    assert r.service_s(new, "h800") == pytest.approx(71.674e-3, rel=1e-4)
    assert r.service_s(new, "h20") == pytest.approx(64.216e-3, rel=1e-4)
    assert r._finish_s(new, "h800") == pytest.approx(297.54e-3, rel=1e-4)
    assert r._finish_s(new, "h20") == pytest.approx(129.95e-3, rel=1e-4)
    d = r.route(new)
    assert (d.replica_id, d.est_wait_s) == ("h20", pytest.approx(65.730e-3, rel=1e-4))


def test_decision_carries_the_replica_index():
    r = hetero()
    assert r.route(req("p", "e1", **PREFILL_HEAVY)).replica_index == 0  # h800, listed first
    d = r.route(req("d", "e2", **DECODE_HEAVY))
    assert (d.replica_id, d.replica_index) == ("h20", 1)


def test_turn_router_returns_engine_indices_and_reports_batches_by_index():
    from rollart.rollout.turn_router import TurnRouter
    from rollart.routing.setup import engine_replica_id
    from rollart.types import GenerationRequest, SamplingParams

    cfg = load_config("configs/default.yaml", ["cluster.engine_pools={H800: 1, H20: 2}"])
    assert [engine_replica_id(i) for i in range(3)] == ["engine-0", "engine-1", "engine-2"]
    tr = TurnRouter(cfg, param_count=lambda: 1e9, dynamic=True)
    decode_heavy = SamplingParams(max_new_tokens=1000)
    # 10 new prompt tokens, ~1000 decode tokens: the H20s (engines 1 and 2); the second episode
    # goes to the idle H20 rather than queueing behind the first.
    first = tr.route("e1", "x", GenerationRequest("r1", [0] * 10, decode_heavy), 10, default=0)
    second = tr.route("e2", "x", GenerationRequest("r2", [0] * 10, decode_heavy), 10, default=0)
    assert (first, second) == (1, 2)
    est = tr.router.metrics()["router/wait_s/engine-2"]
    tr.served(2, ["r2"], busy_s=3 * est)  # engine 2 ran 3x slower than estimated
    m = tr.metrics()
    assert m["rollout/router/scale/engine-2"] == pytest.approx(3.0)
    # the unmeasured engines share the common part of the correction (issue 21)
    assert m["rollout/router/scale/engine-1"] == pytest.approx(3.0)
    assert m["rollout/router/wait_s/engine-2"] == 0.0  # r2 left the queue
