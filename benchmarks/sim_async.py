"""Predict benchmarks/async_vs_sync.py with the simulator (seconds of CPU, no model, no cluster).

The workload is the measured one: two FrozenLake 3x3 tasks (max_turns 8; episodes take 1-8
turns, modelled uniform), one of them behind the heavy-tailed latency
{median_s 0.02, sigma 0.5, tail_prob 0.05, tail_s 0.4, tail_alpha 1.5}; 4 groups x 8; one
engine; the same variants (sync: alpha 0 lockstep; sync_c: alpha 0 continuous; async1, async2:
alpha 1, 2 continuous, gathering wait 0.002 s as rollout.batch_wait_s), 100 iterations each.

Costs (flags; defaults backed out of the measured `sync` variant of results/async_vs_sync.json,
the one where trainer and engine do not compete for the CPU), per iteration, with W = wall /
iterations, the benchmark's idle fractions and its summed trainer wait:

    update_s   = (1 - trainer_idle_frac) * W         (the benchmark's trainer busy = update time)
    engine     = (1 - engine_idle_frac) * W          (time inside generate, per iteration)
    sync_s     = W - update_s - trainer_wait_s / iterations   (sync + scoring + bookkeeping)

The engine time is split into calls and requests: lockstep makes about 8 calls per iteration
(the longest of 32 episodes of 1-8 turns has 8 turns with probability 1 - (7/8)^32 = 0.99)
carrying 32 x 4.5 = 144 turns; `--overhead-share` (default 0.5, an assumption) of it is per-call
overhead, the rest per turn. From the measured file (3 seeds x 150 iterations, lr 1e-3):
update 0.48 s, sync 0.05 s, overhead 0.016 s per call, 0.0009 s per turn. Without the file the
flags' defaults (from an earlier 100-iteration file: 0.38, 0.08, 0.015, 0.0008) are used.
The prediction barely depends on the split (overhead share 0.1 or 0.9 moves walls by < 2%): env
latency dominates. It does depend on the turn distribution (`--turns`): the measured policy
learns the 4-step path, so late episodes are shorter than uniform 1-8 (with --turns 4-4 the
predicted sync wall drops by 7 % and the async speedups to 1.66x / 1.89x).

Writes results/sim_async.json (predicted walls, speedups, idle fractions; measured speedups and
predicted/measured ratios when a measured file is found) and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollart.config import LatencyConfig  # noqa: E402
from rollart.sim import EngineModel, SimConfig, TaskModel, TrainerModel, simulate  # noqa: E402

SLOW = LatencyConfig(median_s=0.02, sigma=0.5, tail_prob=0.05, tail_s=0.4, tail_alpha=1.5)
VARIANTS = {"sync": (0, "lockstep"), "sync_c": (0, "continuous"),
            "async1": (1, "continuous"), "async2": (2, "continuous")}
MEASURED = [Path("results/async_vs_sync.json")]
CALLS, TURNS = 8, 32 * 4.5  # per iteration under lockstep (see the docstring)
FALLBACK = {"update_s": 0.379, "sync_s": 0.076, "engine_s": 0.235}  # from the 100-it. run


def measured() -> tuple[Path | None, dict]:
    for p in MEASURED:
        if p.exists():
            return p, json.loads(p.read_text())
    return None, {}


def backed_out(m: dict) -> dict[str, float]:
    """Per-iteration update, sync and engine seconds from the measured sync variant."""
    s = m.get("variants", {}).get("sync")
    if not s or not m.get("iterations"):
        return dict(FALLBACK)
    w = s["wall_s"] / m["iterations"]
    update = (1 - s["trainer_idle_frac"]) * w
    return {"update_s": update, "sync_s": w - update - s["trainer_wait_s"] / m["iterations"],
            "engine_s": (1 - s["engine_idle_frac"]) * w}


def main() -> None:
    src, meas = measured()
    est = backed_out(meas)
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-share", type=float, default=0.5,
                    help="share of engine time that is per-call overhead")
    ap.add_argument("--overhead-s", type=float, default=None, help="per generate call")
    ap.add_argument("--per-request-s", type=float, default=None, help="per turn in a call")
    ap.add_argument("--update-s", type=float, default=est["update_s"])
    ap.add_argument("--sync-s", type=float, default=est["sync_s"])
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--turns", default="1-8", help="episode turns, uniform over MIN-MAX")
    ap.add_argument("--variants", default="sync,sync_c,async1,async2")
    ap.add_argument("--out", default="results/sim_async.json")
    a = ap.parse_args()
    overhead = a.overhead_s if a.overhead_s is not None else (
        est["engine_s"] * a.overhead_share / CALLS)
    per_req = a.per_request_s if a.per_request_s is not None else (
        est["engine_s"] * (1 - a.overhead_share) / TURNS)
    lo, hi = (int(x) for x in a.turns.split("-"))
    tasks = (TaskModel("lake", turns=(lo, hi)),
             TaskModel("lake-slowtool", turns=(lo, hi), latency=SLOW))
    engine = EngineModel(overhead_s=overhead, per_request_s=per_req, batch_wait_s=0.002)
    trainer = TrainerModel(update_s=a.update_s, sync_s=a.sync_s)
    t0 = time.perf_counter()
    pred = {}
    for name in a.variants.split(","):
        alpha, batching = VARIANTS[name]
        cfg = SimConfig(tasks=tasks, engine=engine, trainer=trainer, group_size=8, num_groups=4,
                        max_staleness=alpha, engines=a.engines, iterations=a.iterations,
                        batching=batching, max_consecutive_failures=0, seed=a.seed)
        pred[name] = simulate(cfg).summary()
    cpu_s = time.perf_counter() - t0
    base = pred.get("sync", next(iter(pred.values())))["wall_s"]
    speedup = {k: base / v["wall_s"] for k, v in pred.items()}
    out: dict = {"iterations": a.iterations, "seed": a.seed, "sim_seconds": cpu_s,
                 "params": {"update_s": a.update_s, "sync_s": a.sync_s, "overhead_s": overhead,
                            "per_request_s": per_req, "engines": a.engines,
                            "turns": a.turns,
                            "backed_out_from": str(src) if src else None},
                 "predicted": pred, "predicted_speedup": speedup}
    line = (f"sim_async: predicted speedup vs sync "
            f"{ {k: round(v, 2) for k, v in speedup.items()} }, walls "
            f"{ {k: round(v['wall_s']) for k, v in pred.items()} } s")
    mv = meas.get("variants", {})
    if "sync" in mv and "sync" in pred:
        scale = a.iterations / meas["iterations"]  # compare like for like
        walls = {k: mv[k]["wall_s"] * scale for k in pred if k in mv}
        mspeed = {k: mv["sync"]["wall_s"] / mv[k]["wall_s"] for k in walls}
        out["measured"] = {"source": str(src), "wall_s_scaled": walls, "speedup": mspeed,
                           "idle": {k: {"trainer": mv[k]["trainer_idle_frac"],
                                        "engine": mv[k]["engine_idle_frac"]} for k in walls}}
        out["predicted_over_measured"] = {
            "wall": {k: pred[k]["wall_s"] / walls[k] for k in walls},
            "speedup": {k: speedup[k] / mspeed[k] for k in mspeed}}
        line += (f"; measured speedup { {k: round(v, 2) for k, v in mspeed.items()} }, "
                 f"predicted/measured wall "
                 f"{ {k: round(v, 2) for k, v in out['predicted_over_measured']['wall'].items()} }")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(line + f" ({cpu_s:.1f} s to simulate)")


if __name__ == "__main__":
    main()
