"""The affinity mix as a full training run (used by benchmarks/affinity.py, `--run-iterations`).

configs/affinity-mix.yaml: a prefill-heavy task (FrozenLake 8x8, a whole map per turn, a short
action) and a decode-heavy one (arithmetic with a long free-form answer) share every batch; two
engine pools (one H800-like, one H20-like replica) under the modelled emulation; continuous
batching routes every turn. The run goes through rollart.runner.local_loop.run_local, the in-process
mode of the iteration driver: the same stages as the Prefect flow (collect, score, update,
sync weights, checkpoint), the same rollout service, router and engines, without a Prefect
server. Each policy runs the same config and seed; iteration time is `perf/iteration_s`, and the
result is the ratio of the medians (round robin / affinity), with the ratio of the mean iteration
times after the first (throughput) next to it.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from rollart.config import load_config
from rollart.runner.local_loop import run_local


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    curve = out["curve"]
    times = [m["perf/iteration_s"] for m in curve]
    last = curve[-1]
    placed = {k.split("/", 2)[2]: int(v) for k, v in last.items() if "/turns_on/" in k}
    decisions = {k: int(last.get(f"rollout/router/{k}", 0))
                 for k in ("new", "sticky", "spill", "failover")}
    engines = []
    for e in out["engines"]:
        s = e.engine.stats()
        engines.append({k: round(s[k], 3) for k in (
            "generate_s", "emulated_modelled_s", "emulated_overrun_s", "forward_s",
            "tokens_generated", "prompt_tokens", "batches")})
    return {
        "iteration_s": {"min": round(min(times), 3), "median": round(statistics.median(times), 3),
                        "max": round(max(times), 3)},
        "iteration_s_runs": [round(t, 3) for t in times],
        # throughput view: with max_staleness 1 iteration times alternate (a batch generated
        # during the previous update is collected at once), so the median of a short run can
        # fall between the two modes; the mean after the warm-up first iteration does not
        "iteration_s_mean_after_first": round(statistics.mean(times[1:] or times), 3),
        "wall_s": round(out["wall_s"], 3),
        "reward_mean_last": round(last.get("reward/mean", float("nan")), 4),
        "placed_turns": placed,
        "decisions": decisions,
        "engines": engines,
    }


def measure_runs(config: str, iterations: int, seed: int = 0,
                 overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """affinity and round robin, `iterations` each, one after the other on the same config."""
    res: dict[str, Any] = {"config": config, "iterations": iterations, "entry": "run_local",
                           "overrides": list(overrides)}
    for policy in ("affinity", "round_robin"):
        with tempfile.TemporaryDirectory() as root:
            cfg = load_config(config, [f"iterations={iterations}", f"seed={seed}",
                                       f"storage.root={root}", "storage.shards=false",
                                       f"routing.policy={policy}", *overrides])
            res[policy] = _summary(run_local(cfg, f"affinity-{policy}"))
        print(f"  run {policy:12s} iteration s {res[policy]['iteration_s']} placed "
              f"{res[policy]['placed_turns']} {res[policy]['decisions']}", flush=True)
    res["speedup"] = round(res["round_robin"]["iteration_s"]["median"]
                           / res["affinity"]["iteration_s"]["median"], 3)
    res["speedup_mean_after_first"] = round(res["round_robin"]["iteration_s_mean_after_first"]
                                            / res["affinity"]["iteration_s_mean_after_first"], 3)
    return res
