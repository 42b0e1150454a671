"""Validation against benchmarks/affinity.py (results/affinity.json), in simulated time.

Check (benchmarks/affinity.py with the modelled emulation of issue 21; AffinityHarness:
SystemSimulation with the real Router and the real RolloutScheduler)
    reads: workload.{episodes_per_task, turns, batch, imbalance_threshold_s, repeats,
    tasks.*.{first_prompt, obs_tokens, new_tokens}}, emulation.{model_params, bytes_per_param,
    time_scale}, replicas.* (the emulated classes), the seed from `command` (default 0), and
    policies.{affinity,round_robin}.{wall_s_runs, decisions_runs, speedup_vs_round_robin_runs,
    runs[].replicas.*.{busy_s, modelled_s, batches}}. Plays each repeat with its seed: the
    benchmark's shuffled arrival order, every first turn queued at t=0, FIFO batches of up to
    `batch` timed by the real ServiceModel.batch_s (the emulation's sleep), the router told
    on_started / on_batch / on_finished as the benchmark does, no prefix cache, env step 0, one
    iteration, no update. Compares the medians over the repeats (the benchmark's statistic) of
    each policy's wall and of round robin / affinity; per-repeat errors are reported. A policy's
    wall is scored only if the simulated router took the measured decision counts in every
    repeat (the simulator has no host timing noise; a wall the noise decided is reported, not
    scored); the ratio only if both are. `replay` (never scored) re-runs each repeat with its
    replicas' measured host overhead per batch. Fidelity = measured busy / modelled time
    (> FIDELITY_LIMIT: the file measured host overhead, not the emulation: instrument false).
    A file without the modelled emulation (the pre-issue-21 layout) is not an instrument.

Why the affinity wall is not predictable from this file (the `race` diagnostic): on this
workload the affinity policy's outcome is a race. At t ~ 0.93 s (simulated, seed 0) the H800
replica ends its 5th batch 32 ms before the H20 replica ends its 2nd; the reason turns that
come back from the H20 then see an idle H800 and spill to it (7 spills, wall 2.06 s). If the
H800's batches end later than modelled by more than ~6.3 ms each (32 ms over its 5 batches),
the H800 is still busy when they are routed, they stay on the H20 (3 spills) and the run takes
2.66 s. The benchmark's replicas are threads on a shared 2-core host: each engine call costs
host time beyond the modelled sleep (sleep wake-up, the GIL, building completions), measured
per run as (busy - modelled) / batches, 0.7-75.7 ms per batch over the file's 30
replica-runs. `race` finds, for every repeat and replica, the smallest constant host overhead
per batch at which the simulated router's decisions change, and compares it with the measured
one: that comparison explains which branch each measured repeat took. The simulator has no
model of that host time (it is not a property of the emulated hardware), so for the median of
five repeats it predicts the branch the zero-overhead race gives.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from typing import Any

from rollart.rollout.scheduler import Start
from rollart.routing.catalog import HardwareClass
from rollart.routing.emulation import ServiceModel
from rollart.sim.cluster import ModelSpec, PoolModel, RoutingModel, SystemConfig
from rollart.sim.simulator import _Episode
from rollart.sim.system import SystemSimulation
from rollart.sim.workload import EngineModel, SimConfig, TaskModel, TrainerModel

# Engines that took more than this times the cost model's time for the tokens they processed
# measured something the cost model does not describe (CPU contention, padding, host compute).
FIDELITY_LIMIT = 1.5
RACE_MAX_OVERHEAD_S = 0.025  # `race` looks for a decision change up to this host time per batch
RACE_STEPS = 7  # bisection steps (resolution RACE_MAX_OVERHEAD_S / 2**7 = 0.2 ms)


def _err(pred: float, meas: float) -> float:
    return abs(pred / meas - 1.0)


def benchmark_order(seed: int, episodes_per_task: int, tasks: list[str]) -> list[str]:
    """The arrival order of one repeat of benchmarks/affinity.py (run_policy): its
    random.Random(seed) shuffles [each task x episodes_per_task] before anything else is drawn
    (tasks in the file's order). An input of the benchmark, replayed, not fitted."""
    rng = random.Random(seed)
    order = [t for t in tasks for _ in range(episodes_per_task)]
    rng.shuffle(order)
    return order


class AffinityHarness(SystemSimulation):
    """benchmarks/affinity.py's harness around the real Router, in simulated time.

    - every first turn is queued at t=0 in the benchmark's shuffled task order (the real
      RolloutScheduler still starts the episodes; only their launch order is the benchmark's);
    - each replica drains its queue FIFO in batches of up to `max_batch` (ReplicaServer),
      telling the router `on_started` when a batch starts and `on_batch` when it ends;
    - a batch takes what the replica's emulation sleeps: the real `ServiceModel.batch_s` of its
      class (one prefill pass over the batch's prompt tokens, then decode steps with the rows
      still generating, each max(rows x FLOPs / FLOP/s, weight bytes / bandwidth)), plus
      `overhead_s[replica]` (0 unless a replay gives the measured host overhead per batch);
    - at a batch's end each completion in turn is finished with the router and its episode's
      next turn routed at once (env step 0), before the next completion, as on_done does."""

    def __init__(self, cfg: SystemConfig, order: list[str], service: dict[str, ServiceModel],
                 overhead_s: Mapping[str, float] | None = None):
        super().__init__(cfg)
        self.order, self.service = order, [service[hw.name] for hw in self.hw]
        self.overhead_s = [float((overhead_s or {}).get(rid, 0.0)) for rid in self.rids]
        self.placed = {f"{t.name}/{hw.name}": 0 for t in cfg.sim.tasks for hw in self.hw}

    def _launch(self, starts: list[Start]) -> None:
        by_task: dict[str, list[Start]] = {}
        for st in starts:
            by_task.setdefault(st.task, []).append(st)
        first = [by_task[t].pop(0) for t in self.order if by_task.get(t)]
        super()._launch(first + [st for sts in by_task.values() for st in sts])

    def _request(self, ep: _Episode) -> None:
        super()._request(ep)
        self.placed[f"{ep.start.task}/{self.hw[ep.engine].name}"] += 1

    def _dispatch(self, e: int) -> None:
        eng = self.engines[e]
        eng.pending = False
        if eng.running or not eng.queue:
            return
        n = self._max_batch(e)
        items, eng.queue = eng.queue[:n], eng.queue[n:]  # FIFO, as ReplicaServer
        self.routers[self.shard_of[e]].on_started(self.rids[e], [rid for rid, _ in items])
        prompts = [int(self.turn[rid][1]) for rid, _ in items]
        dur = self.service[e].batch_s(prompts, [int(self.turn[rid][2]) for rid, _ in items])
        dur += self.overhead_s[e]
        self.inflight[e], self.call_dur[e] = items, dur
        eng.running, eng.call_end = len(items), self.now + dur
        eng.busy_s += dur
        eng.calls += 1
        self._at(eng.call_end, self._call_done, e, items)

    def _call_done(self, e: int, items: list[tuple[str, _Episode]]) -> None:
        self.inflight[e] = None
        self.routers[self.shard_of[e]].on_batch(self.rids[e], [rid for rid, _ in items],
                                                self.call_dur[e])
        self.engines[e].running = 0
        for rid, ep in items:
            self._turn_done(e, rid, ep)
            if not ep.cancelled:
                self._env_done(ep)  # the next turn is routed before the next completion
        self._wake(e)


DECISIONS = ("new", "sticky", "spill", "failover")


def simulate_affinity_bench(m: dict, policy: str, seed: int,
                            overhead_s: Mapping[str, float] | None = None) -> dict[str, Any]:
    """One repeat of benchmarks/affinity.py (file `m`) under `policy`, simulated: wall, router
    decisions, placements, each replica's busy time."""
    w, em = m["workload"], m["emulation"]
    tasks = tuple(TaskModel(name, turns=(w["turns"], w["turns"]),
                            first_prompt_tokens=t["first_prompt"], obs_tokens=t["obs_tokens"],
                            decode_tokens=t["new_tokens"]) for name, t in w["tasks"].items())
    classes = [HardwareClass(**h) for h in m["replicas"].values()]
    service = {c.name: ServiceModel(c, params=em["model_params"],
                                    bytes_per_param=em["bytes_per_param"],
                                    time_scale=em["time_scale"], forward=False) for c in classes}
    sim = SimConfig(tasks=tasks, engine=EngineModel(overhead_s=1e-9), trainer=TrainerModel(0.0),
                    group_size=1, num_groups=w["episodes_per_task"] * len(tasks), iterations=1,
                    seed=seed, batching="continuous", max_consecutive_failures=0)
    pools = tuple(PoolModel(c.name, 1, gpus_per_replica=1, max_batch=w["batch"], prefill_eff=1.0,
                            decode_eff=1.0, batching="static") for c in classes)
    # the benchmark's router: CostModel.for_model(params, bytes, decode_batch=batch), no cache
    cfg = SystemConfig(sim=sim, pools=pools, catalog={c.name: c for c in classes},
                       model=ModelSpec(params=em["model_params"],
                                       bytes_per_param=em["bytes_per_param"], active_params=None),
                       routing=RoutingModel(policy=policy, prefix_cache=False,
                                            imbalance_threshold_s=w["imbalance_threshold_s"]))
    h = AffinityHarness(cfg, benchmark_order(seed, w["episodes_per_task"], list(w["tasks"])),
                        service, overhead_s)
    res = h.run_system()
    return {"wall_s": res.sim.wall_s,
            "busy_s": dict(zip(h.rids, res.sim.engine_busy_s, strict=True)),
            "decisions": {k: int(res.router[f"router/{k}"]) for k in DECISIONS},
            "placed": h.placed}


def _affinity_policy(m: dict, policy: str, seeds: list[int], replay: bool) -> dict[str, Any]:
    """Predicted vs measured walls of `policy` over the file's repeats. replay: each repeat with
    its replicas' measured host overhead per batch (busy - modelled) / batches."""
    p = m["policies"][policy]
    sims = []
    for s, run in zip(seeds, p["runs"], strict=True):
        ov = ({k: (r["busy_s"] - r["modelled_s"]) / max(r["batches"], 1)
               for k, r in run["replicas"].items()} if replay else None)
        sims.append(simulate_affinity_bench(m, policy, s, ov))
    pred = [x["wall_s"] for x in sims]
    meas = [float(x) for x in p["wall_s_runs"]]
    measured_dec = [{k: int(d[k]) for k in DECISIONS} for d in p["decisions_runs"]]
    return {"predicted_wall_s": statistics.median(pred),
            "measured_wall_s": statistics.median(meas),
            "error": _err(statistics.median(pred), statistics.median(meas)),
            "predicted_wall_s_runs": pred, "measured_wall_s_runs": meas,
            "error_runs": [_err(a, b) for a, b in zip(pred, meas, strict=True)],
            "same_decisions_runs": [x["decisions"] == d
                                    for x, d in zip(sims, measured_dec, strict=True)],
            "predicted_decisions_runs": [x["decisions"] for x in sims],
            "measured_decisions_runs": measured_dec,
            "predicted_placed_runs": [x["placed"] for x in sims],
            "measured_placed_runs": p["placed_turns_runs"],
            "predicted_busy_s_runs": [x["busy_s"] for x in sims],
            "measured_modelled_s_runs": [{k: r["modelled_s"] for k, r in run["replicas"].items()}
                                         for run in p["runs"]]}


def _speedups(pol: dict[str, dict]) -> list[float]:
    return [r / a for r, a in zip(pol["round_robin"]["predicted_wall_s_runs"],
                                  pol["affinity"]["predicted_wall_s_runs"], strict=True)]


def validate_affinity(m: dict, explain: bool = True) -> dict[str, Any]:
    """Every repeat of the file simulated with its own seed, per policy; errors on the medians
    over the repeats (the benchmark's own statistic), per-repeat errors shown. A policy's wall is
    scored (counted in `scored_error`, hence in validation_max_error) only if the simulated
    router took the measured decisions in every repeat: the simulator has no host timing noise,
    so a wall that noise decided is not a prediction target; the ratio is scored when both
    walls are. `replay` (shown, never scored): the same with each repeat's measured host
    overhead per batch as an input, which tells whether that overhead explains the rest."""
    em = m.get("emulation", {})
    if em.get("mode") != "modelled":
        return {"policies": {}, "instrument": False, "max_error": None,
                "why_not": "the file predates the modelled emulation (issue 21): its replicas "
                           "measured host compute under CPU contention, not a cost model"}
    seed0 = _cli_int(m.get("command", ""), "--seed", 0)
    seeds = [seed0 + r for r in range(int(m["workload"]["repeats"]))]
    pol = {k: _affinity_policy(m, k, seeds, False) for k in ("affinity", "round_robin")}
    for v in pol.values():
        v["scored"] = all(v["same_decisions_runs"])
    sp = _speedups(pol)
    msp = [float(x) for x in m["policies"]["affinity"]["speedup_vs_round_robin_runs"]]
    out: dict[str, Any] = {
        "policies": pol, "seeds": seeds,
        "compared": "medians over the repeats (per-repeat errors shown)",
        "predicted_speedup": statistics.median(sp), "measured_speedup": statistics.median(msp),
        "speedup_error": _err(statistics.median(sp), statistics.median(msp)),
        "predicted_speedup_runs": sp, "measured_speedup_runs": msp}
    errors = {f"{k}_wall": v["error"] for k, v in pol.items()}
    errors["speedup"] = out["speedup_error"]
    scored = [f"{k}_wall" for k, v in pol.items() if v["scored"]]
    if all(v["scored"] for v in pol.values()):
        scored.append("speedup")
    out.update(errors=errors, max_error=max(errors.values()), scored=scored,
               scored_error=max((errors[k] for k in scored), default=None))
    fid = [r["busy_s"] / r["modelled_s"] for k in pol for run in m["policies"][k]["runs"]
           for r in run["replicas"].values() if r["modelled_s"]]
    out["max_engine_fidelity"] = worst = max(fid, default=1.0)
    out["instrument"] = worst <= FIDELITY_LIMIT
    if not out["instrument"]:
        out["why_not"] = (f"a replica was busy {worst:.2f}x the time its emulation modelled "
                          f"(limit {FIDELITY_LIMIT}): the file measured host overhead, not the "
                          f"modelled hardware")
    rp = {k: _affinity_policy(m, k, seeds, True) for k in pol}
    rsp = _speedups(rp)
    out["replay"] = {
        "what": "each repeat with its replicas' measured host overhead per batch (busy_s - "
                "modelled_s) / batches added to every batch: an explanation, not a prediction",
        "policies": {k: {x: v[x] for x in ("predicted_wall_s", "error", "predicted_wall_s_runs",
                                           "error_runs", "same_decisions_runs")}
                     for k, v in rp.items()},
        "predicted_speedup": statistics.median(rsp),
        "speedup_error": _err(statistics.median(rsp), statistics.median(msp))}
    unscored = [k for k, v in pol.items() if not v["scored"]]
    out["race"] = {k: race(m, k, seeds, pol[k]) for k in unscored} if explain else {}
    if unscored:
        out["not_scored_why"] = "; ".join(_why(k, pol[k], out["race"].get(k)) for k in unscored) + (
            f"; median speedup measured {out['measured_speedup']:.3f}x, predicted "
            f"{out['predicted_speedup']:.3f}x ({out['speedup_error']:.1%})")
    return out


def measured_overhead_s(run: dict) -> dict[str, float]:
    """Each replica's host time per batch beyond the modelled sleep in one measured run."""
    return {k: (r["busy_s"] - r["modelled_s"]) / max(r["batches"], 1)
            for k, r in run["replicas"].items()}


def flip_overhead_s(m: dict, policy: str, seed: int, rid: str,
                    base: dict[str, int]) -> float | None:
    """The smallest constant host overhead per batch on replica `rid` (none elsewhere) at which
    the simulated router's decisions in this repeat differ from `base` (theirs with none), to
    RACE_MAX_OVERHEAD_S / 2**RACE_STEPS; None: no change up to RACE_MAX_OVERHEAD_S. Bisection:
    one change in that range is assumed."""
    def moved(x: float) -> bool:
        return simulate_affinity_bench(m, policy, seed, {rid: x})["decisions"] != base

    lo, hi = 0.0, RACE_MAX_OVERHEAD_S
    if not moved(hi):
        return None
    for _ in range(RACE_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if moved(mid) else (mid, hi)
    return hi


def race(m: dict, policy: str, seeds: list[int], v: dict[str, Any]) -> dict[str, Any]:
    """Per repeat: the host overhead per batch at which each replica flips the simulated
    decisions, the measured overhead, and whether "some replica's measured overhead reached its
    threshold" is exactly "the measured decisions differ from the simulated ones"."""
    runs = m["policies"][policy]["runs"]
    thr = [{rid: flip_overhead_s(m, policy, s, rid, base) for rid in m["replicas"]}
           for s, base in zip(seeds, v["predicted_decisions_runs"], strict=True)]
    meas = [measured_overhead_s(run) for run in runs]
    crossed = [any(t[r] is not None and o[r] >= t[r] for r in t)
               for t, o in zip(thr, meas, strict=True)]
    return {"what": "smallest constant host overhead per batch on one replica that changes the "
                    "simulated router's decisions (flip_overhead_s), vs the measured one; "
                    "explained: crossing it <=> the measured decisions differ",
            "flip_overhead_s_runs": thr, "measured_overhead_s_runs": meas,
            "crossed_runs": crossed,
            "explained_runs": [c == (not same) for c, same in
                               zip(crossed, v["same_decisions_runs"], strict=True)]}


def _why(policy: str, v: dict[str, Any], r: dict[str, Any] | None) -> str:
    bad = [i for i, ok in enumerate(v["same_decisions_runs"]) if not ok]
    meas = [v["measured_decisions_runs"][i] for i in bad]
    pred = [v["predicted_decisions_runs"][i] for i in bad]
    return (f"{policy}: in repeat(s) {bad} the benchmark's router decided {meas}, the simulated "
            f"one (same seed, no host timing noise) {pred}; walls measured "
            f"{v['measured_wall_s_runs']} s (median {v['measured_wall_s']:.3f} s), predicted "
            f"{[round(x, 3) for x in v['predicted_wall_s_runs']]} s (median "
            f"{v['predicted_wall_s']:.3f} s): {v['error']:.1%}" + ("" if r is None else
            f". A race decides the branch: host overhead per batch that flips the simulated "
            f"decisions "
            f"{_ms(r['flip_overhead_s_runs'])}, measured {_ms(r['measured_overhead_s_runs'])} "
            f"(ms per repeat and replica); crossing it explains the measured branch in "
            f"{sum(r['explained_runs'])} of {len(r['explained_runs'])} repeats"))


def _ms(runs: list[dict[str, float | None]]) -> list[dict[str, float | None]]:
    return [{k: None if x is None else round(1000 * x, 1) for k, x in run.items()}
            for run in runs]


def _cli_int(command: str, flag: str, default: int) -> int:
    words = command.split()
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith(flag + "="):
            return int(word.split("=", 1)[1])
    return default
