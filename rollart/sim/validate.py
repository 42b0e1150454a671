"""Validation: the simulator against our own measured benchmarks (the committed results/*.json).

Each check reads the workload and the component costs a benchmark recorded, simulates it and
compares wall times; error = |predicted / measured - 1|. Nothing is fitted to the walls compared.

async_vs_sync (results/async_vs_sync.json; rollart.sim.Simulation, the real RolloutScheduler)
    reads: iterations, workload (tasks' max_turns and latency blocks, rollout.num_groups,
    rollout.group_size), variants.{sync,async1,async2}.{wall_s, trainer_idle_frac,
    engine_idle_frac, trainer_wait_s}. Engine and sync costs are backed out of the sync variant
    (as benchmarks/sim_async.py does); the update time of each variant is its own measured
    trainer busy time per update (on the 2-core host the update slows by ~35 % when it overlaps
    generation: contention is an input, not something the simulator predicts). Turns per
    episode: uniform 1..max_turns (an assumption). Walls: mean over `seeds` simulated seeds vs
    the mean over the measured seeds (the env tail is Pareto(1.5): single runs scatter widely).
affinity (results/affinity_ts10.json: `benchmarks/affinity.py --time-scale 10`):
    rollart.sim.validate_affinity (its docstring). At time scale 1 (results/affinity.json, the
    speedup figure of the affinity benchmark) the affinity run is a race decided by ms of host
    time per engine call, which the simulator does not model; ten times longer modelled
    batches make the same race's margin ~320 ms, far above the host time, so that file measures
    what the simulator models. The time-scale-1 file is still checked and reported
    (`affinity_time_scale_1`, not an instrument), outside `max_error` and `max_error_all`.
reward_elastic (results/reward_elastic.json; rollart.sim.rewards.RewardPool)
    reads: episodes_per_burst, bursts, cost_s (the costs are replayed with the benchmark's own
    seeded draw), {elastic,fixed}.{concurrency, bursts[].makespan_s}, and the cold start from
    elastic.live_workers_timeline (midpoint of the sample interval in which the live workers
    first reach the peak). Per-invocation overhead 0. Each burst starts cold (the benchmark waits
    out the idle period between bursts).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

from rollart.config import LatencyConfig
from rollart.sim.rewards import RewardModel, RewardPool
from rollart.sim.simulator import simulate
from rollart.sim.validate_affinity import (
    FIDELITY_LIMIT,
    benchmark_order,
    simulate_affinity_bench,
    validate_affinity,
)
from rollart.sim.workload import EngineModel, SimConfig, TaskModel, TrainerModel

AFFINITY_FILE = "affinity_ts10"  # the affinity benchmark the validation scores

__all__ = ["FIDELITY_LIMIT", "TOLERANCE", "benchmark_order", "simulate_affinity_bench",
           "validate_affinity", "validate_all", "validate_async", "validate_rewards"]

TOLERANCE = 0.15
CALLS, TURNS = 8, 32 * 4.5  # lockstep calls and turns per iteration (see benchmarks/sim_async.py)
ASYNC_VARIANTS = {"sync": (0, "lockstep"), "async1": (1, "continuous"),
                  "async2": (2, "continuous")}


def _err(pred: float, meas: float) -> float:
    return abs(pred / meas - 1.0)


def _async_tasks(m: dict) -> tuple[tuple[TaskModel, ...], int, int]:
    kv = dict(w.split("=", 1) for w in m.get("workload", []) if "=" in w)
    tasks = tuple(TaskModel(t["name"], turns=(1, int(t.get("max_turns", 8))),
                            latency=LatencyConfig(**t.get("latency", {})))
                  for t in yaml.safe_load(kv["tasks"]))
    return tasks, int(kv.get("rollout.group_size", 8)), int(kv.get("rollout.num_groups", 4))


def validate_async(m: dict, seeds: int = 8, overhead_share: float = 0.5,
                   sync_update_too: bool = False) -> dict[str, Any]:
    tasks, group_size, num_groups = _async_tasks(m)
    it = int(m["iterations"])
    s = m["variants"]["sync"]
    w = s["wall_s"] / it
    sync_update = (1 - s["trainer_idle_frac"]) * w
    sync_s = w - sync_update - s["trainer_wait_s"] / it
    engine_s = (1 - s["engine_idle_frac"]) * w
    engine = EngineModel(overhead_s=engine_s * overhead_share / CALLS,
                         per_request_s=engine_s * (1 - overhead_share) / TURNS, batch_wait_s=0.002)
    out: dict[str, Any] = {"iterations": it, "seeds": seeds, "sync_s": sync_s,
                           "engine_s_per_iteration": engine_s, "variants": {}}
    for name, (alpha, batching) in ASYNC_VARIANTS.items():
        v = m["variants"].get(name)
        if v is None:
            continue
        update = (1 - v["trainer_idle_frac"]) * v["wall_s"] / it
        walls = {}
        runs = [("per_variant_update", update)]
        if sync_update_too:  # the same with the sync run's update time (no contention)
            runs.append(("sync_update", sync_update))
        for label, upd in runs:
            cfgs = [SimConfig(tasks=tasks, engine=engine, trainer=TrainerModel(upd, sync_s),
                              group_size=group_size, num_groups=num_groups,
                              max_staleness=alpha, iterations=it, batching=batching, seed=k,
                              max_consecutive_failures=0)
                    for k in range(seeds)]
            walls[label] = sum(simulate(c).wall_s for c in cfgs) / seeds
        pred = walls["per_variant_update"]
        out["variants"][name] = {
            "update_s": update, "predicted_wall_s": pred, "measured_wall_s": v["wall_s"],
            "error": _err(pred, v["wall_s"])}
        if sync_update_too:  # shown, not scored
            out["variants"][name].update(
                predicted_wall_s_sync_update=walls["sync_update"],
                error_sync_update=_err(walls["sync_update"], v["wall_s"]))
    out["max_error"] = max(v["error"] for v in out["variants"].values())
    return out


def validate_rewards(m: dict) -> dict[str, Any]:
    rng = random.Random(m.get("seed", 0))  # benchmarks/reward_elastic.py's own draw
    lo, hi = m["cost_s"]
    costs = [[rng.uniform(lo, hi) for _ in range(m["episodes_per_burst"])]
             for _ in range(m["bursts"])]
    timeline = m["elastic"]["live_workers_timeline"]
    peak = m["elastic"]["peak_workers"]
    i = next(k for k, (_, live) in enumerate(timeline) if live >= peak)
    cold = (timeline[i][0] + timeline[i - 1][0]) / 2 if i else timeline[0][0]
    out: dict[str, Any] = {"cold_start_s": cold, "modes": {}}
    for mode in ("elastic", "fixed"):
        r = m[mode]
        pred = []
        for burst in costs:
            pool = RewardPool(RewardModel(kind="serverless", workers=r["concurrency"],
                                          cold_start_s=cold, idle_s=float("inf")))
            pred.append(max(pool.submit(0.0, c) for c in burst))
        meas = [b["makespan_s"] for b in r["bursts"]]
        pm, mm = sum(pred) / len(pred), sum(meas) / len(meas)
        out["modes"][mode] = {"predicted_makespan_s": pm, "measured_makespan_s": mm,
                              "error": _err(pm, mm)}
    out["max_error"] = max(v["error"] for v in out["modes"].values())
    return out


def validate_all(results: Path = Path("results"), seeds: int = 8) -> dict[str, Any]:
    """Every check whose file exists. `max_error`: over the scored parts of the checks that are
    instruments (affinity: `scored`); `max_error_all`: over every part, scored or not."""
    checks = {"async_vs_sync": lambda m: validate_async(m, seeds),
              "affinity": validate_affinity, "reward_elastic": validate_rewards}
    out: dict[str, Any] = {}
    for name, fn in checks.items():
        path = results / f"{AFFINITY_FILE if name == 'affinity' else name}.json"
        if path.exists():
            out[name] = fn(json.loads(path.read_text()))
            out[name].setdefault("instrument", True)
            out[name]["file"] = str(path)
    scored = [v.get("scored_error", v["max_error"]) for v in out.values() if v["instrument"]]
    every = [v["max_error"] for v in out.values() if v["max_error"] is not None]
    out["max_error"] = max((x for x in scored if x is not None), default=None)
    out["max_error_all"] = max(every, default=None)  # scored or not
    out["tolerance"] = TOLERANCE
    ts1 = results / "affinity.json"
    if "affinity" in out and ts1.exists():  # reported, outside both maxima (see AFFINITY_FILE)
        d = validate_affinity(json.loads(ts1.read_text()), explain=False)
        out["affinity_time_scale_1"] = {
            "instrument": False, "file": str(ts1), "max_error": d["max_error"],
            "errors": d["errors"],
            "why_not": "time scale 1: the host time of an engine call (0.7-76 ms per batch "
                       "measured) decides a race whose margin is ~32 ms; the simulator models "
                       "the hardware, not the host"}
    return out
