"""What does trajectory-level asynchrony buy? The same multi-task workload, synchronous vs async.

Two tasks share every batch: FrozenLake, and FrozenLake behind a heavy-tailed step latency (the
stand-in for slow tools and sandboxes: lognormal steps plus rare Pareto stalls). Episodes end
after 1-8 turns, so generation per episode is long-tailed too. The variants run one after the
other in this process, with the same seeds and iteration count, through the same rollout
service (rollart/rollout/service.py) and local loop as every run:

    sync     max_staleness 0, lockstep batching  (generate a batch, wait for all, train)
    sync_c   max_staleness 0, continuous batching (no batch barrier per turn, still no overlap)
    async1   max_staleness 1, continuous          (the next batch runs while the trainer trains)
    async2   max_staleness 2, continuous

Reported per variant: wall time, final reward (mean train reward of the last `--tail`
iterations) and greedy eval success, and idle fractions: trainer = 1 - update time / wall,
engine = 1 - time inside `generate` / wall. `speedup` = sync wall / async1 wall.

Each seed (`--seeds 0,1,2`) runs every variant, interleaved; the JSON holds the mean over seeds
per variant and each seed's run.

Every variant runs with Dr. GRPO advantages (no division by the group std) and the trainer's
trust-region guard `train.max_kl: 0.05`. Without them, alpha = 1 collapsed in 3 of 4
100-iteration runs and sync in none of 3: the reward fell within one update (1.0 -> 0.09, or
0.4 -> -0.1 where no turn names an action) and stayed there, because once every group has
equal rewards there is no gradient back. The collapsing updates were single Adam steps with a
small gradient norm (0.19, below the clip) but a huge policy change (approx KL ~1, median
0.0014); on stale batches they happened, on fresh ones they did not (max 0.27). Std
normalisation makes it worse: when a group all succeeds, reward differences of ~0.01 (a turn
without an action) become unit advantages. To see it again: `--variants async1,sync
--set algo.normalize_std=true --set train.max_kl=0` (collapses are random: async runs are not
deterministic; look at train/approx_kl and reward/mean in each run's metrics.jsonl).

Writes results/async_vs_sync.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollart.config import load_config  # noqa: E402
from rollart.runner.local_loop import run_local  # noqa: E402

VARIANTS = {
    "sync": ["rollout.max_staleness=0", "rollout.batching=lockstep"],
    "sync_c": ["rollout.max_staleness=0", "rollout.batching=continuous"],
    "async1": ["rollout.max_staleness=1", "rollout.batching=continuous"],
    "async2": ["rollout.max_staleness=2", "rollout.batching=continuous"],
    "async1_lockstep": ["rollout.max_staleness=1", "rollout.batching=lockstep"],
}

LEARNED = 0.8  # reward at which the lake counts as learned (1.0 = always reaches the goal)
SLOW = "{median_s: 0.02, sigma: 0.5, tail_prob: 0.05, tail_s: 0.4, tail_alpha: 1.5}"


def workload(iterations: int, root: str) -> list[str]:
    # A 3x3 lake (one hole): learnable from random init within the benchmark's iterations.
    task = ("{{name: {name}, env_id: FrozenLake-v1, env_kwargs: {{desc: [SFF, FHF, FFG], "
            "is_slippery: false}}, max_turns: 8, format_credit: action, constrained: true, "
            "seeds: fixed{extra}}}")
    tasks = [task.format(name="lake", extra=""),
             task.format(name="lake-slowtool", extra=f", latency: {SLOW}")]
    return [f"iterations={iterations}", f"tasks=[{', '.join(tasks)}]",
            "rollout.num_groups=4", "rollout.group_size=8", "reward.backend=local",
            "eval.episodes=32", "eval.every=0", f"storage.root={root}",
            "storage.save_every=100000", "storage.shards=false", "train.lr=0.001",
            # For every variant (module docstring): Dr. GRPO advantages, and the trust-region
            # guard (an update whose batch KL exceeds 0.05 is scaled back).
            "algo.normalize_std=false", "train.max_kl=0.05"]


def run_variant(name: str, iterations: int, root: str, tail: int,
                extra: list[str] | None = None) -> dict:
    cfg = load_config("configs/default.yaml",
                      workload(iterations, root) + VARIANTS[name] + list(extra or []))
    t0 = time.perf_counter()
    out = run_local(cfg, f"{name}-{int(time.time())}",
                    on_iteration=lambda r: print(name, r, flush=True))
    wall = time.perf_counter() - t0
    curve = out["curve"]
    update_s = sum(m["perf/update_s"] for m in curve)
    engine_s = sum(out["rollout"]["engine_busy_s"])
    last = curve[-tail:]
    return {
        "wall_s": wall,
        "final_reward": sum(m["reward/mean"] for m in last) / len(last),
        "final_success": sum(m["rollout/success_rate"] for m in last) / len(last),
        "eval_success": curve[-1].get("eval/success_rate"),
        "trainer_idle_frac": 1 - update_s / wall,
        "engine_idle_frac": 1 - engine_s / wall,
        "trainer_wait_s": sum(m.get("rollout/wait_s", 0.0) for m in curve),
        "dropped_stale_episodes": curve[-1].get("rollout/dropped_stale_episodes", 0.0),
        "episodes_consumed": sum(m["rollout/episodes"] for m in curve),
        # Stragglers that go stale are dropped: does the slow task keep its share of batches?
        "slow_task_share": sum(m.get("rollout/task/lake-slowtool/episodes", 0.0) for m in curve)
        / sum(m["rollout/episodes"] for m in curve),
        "max_token_staleness": max(m.get("train/staleness_max", 0.0) for m in curve),
        # Weight sync while generating: the engine's blocked time, and the whole sync call
        # (which also waits for the generate call in progress).
        "sync_pause_s_median": statistics.median(m["perf/sync_pause_s"] for m in curve),
        "sync_pause_s_max": max(m["perf/sync_pause_s"] for m in curve),
        "sync_s_median": statistics.median(m["perf/sync_s"] for m in curve),
        "sync_s_max": max(m["perf/sync_s"] for m in curve),
        "reward_curve": [round(m["reward/mean"], 4) for m in curve],
        # Learning speed, per update and per second: when the trailing 10-iteration mean
        # reward first reaches LEARNED (None: never).
        **learned_at(curve),
    }


def learned_at(curve: list[dict], window: int = 10) -> dict:
    rewards = [m["reward/mean"] for m in curve]
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1:i + 1]) / window >= LEARNED:
            return {"learned_at_iteration": i, "learned_at_s": curve[i]["perf/elapsed_s"]}
    return {"learned_at_iteration": None, "learned_at_s": None}


def aggregate(runs: list[dict]) -> dict:
    """Mean over seeds of every scalar figure; the per-seed runs are kept under `seeds`."""
    out: dict = {}
    for key in runs[0]:
        vals = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) for v in vals):
            out[key] = sum(vals) / len(vals)
        elif all(v is None or isinstance(v, (int, float)) for v in vals):
            out[key] = None  # e.g. learned_at_*: some seed never got there
    for key in ("final_reward", "wall_s", "learned_at_iteration", "learned_at_s"):
        out[f"{key}_by_seed"] = [r.get(key) for r in runs]
    out["seeds"] = runs
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--tail", type=int, default=10, help="iterations averaged for final reward")
    ap.add_argument("--variants", default="sync,async1,async2", help="also: sync_c")
    ap.add_argument("--seeds", default="0", help="comma list; each seed runs every variant")
    ap.add_argument("--out", default="results/async_vs_sync.json")
    ap.add_argument("--set", action="append", default=[], dest="extra",
                    help="extra override for every variant, e.g. train.lr=0.001")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rollart-async-")
    seeds = [int(x) for x in args.seeds.split(",")]
    names = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for seed in seeds:  # interleaved, so slow drifts of the machine hit every variant alike
        for v in names:
            run = run_variant(v, args.iterations, root, args.tail, args.extra + [f"seed={seed}"])
            runs[v].append({"seed": seed, **run})
    res = {v: aggregate(rs) for v, rs in runs.items()}
    sync, fast = res.get("sync", {}), res.get("async1", {})
    if not sync or not fast:  # a partial comparison (--variants): no headline figures
        Path(args.out).write_text(json.dumps({"variants": res}, indent=2))
        print({k: (round(v["wall_s"], 1), round(v["final_reward"], 3)) for k, v in res.items()})
        return
    out = {
        "iterations": args.iterations,
        "seeds": seeds,
        "workload": workload(args.iterations, "<tmp>") + list(args.extra),
        "variants": res,
        # Means over seeds; speedup = mean sync wall / mean async1 wall (same iterations).
        "sync_wall_s": sync["wall_s"],
        "async_wall_s": fast["wall_s"],
        "speedup": sync["wall_s"] / fast["wall_s"],
        "speedup_by_variant": {k: sync["wall_s"] / v["wall_s"] for k, v in res.items()},
        "sync_final_reward": sync["final_reward"],
        "async_final_reward": fast["final_reward"],
        "final_reward_gap": abs(sync["final_reward"] - fast["final_reward"]),
        "final_reward_gap_by_variant": {k: sync["final_reward"] - v["final_reward"]
                                        for k, v in res.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    by_variant = {k: (round(out["speedup_by_variant"][k], 2), round(v["final_reward"], 3))
                  for k, v in res.items()}
    print(f"async_vs_sync: speedup={out['speedup']:.2f} (sync {sync['wall_s']:.0f} s, "
          f"async1 {fast['wall_s']:.0f} s, same {args.iterations} iterations, "
          f"mean of seeds {seeds}) final_reward sync={sync['final_reward']:.3f} "
          f"async1={fast['final_reward']:.3f} (speedup, final_reward) by variant: {by_variant}")


if __name__ == "__main__":
    main()
