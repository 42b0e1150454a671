"""Does a sharded trainer learn as one rank does? SmolLM2-135M-Instruct on verifiable arithmetic
(`configs/smollm2-arith.yaml`) through the Prefect flow, as a user runs it, with 1 trainer rank
and with 2 (`train.world_size=2` on two H800 workers), the same seed and data. Writes
results/sharded_learning.json and prints one summary line.

    .venv/bin/python benchmarks/sharded_learning.py [--iterations 12] [--seeds 0]

Each run evaluates its initial policy before training (`eval.before_training`: 32 held-out
problems, greedy) and again every 6 iterations and at the end; the file holds held-out accuracy
before and after per run, the training reward curve, and the seconds per iteration.
The two runs are not bit-identical (the sharded update sums in another order, and runs the
plain forward where one rank shares each group's prompt), so they are compared as curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sharded_trainer import _host  # noqa: E402

CONFIG = "configs/smollm2-arith.yaml"


def one_run(world: int, seed: int, iterations: int, root: Path) -> dict:
    run_id = f"sharded-learning-w{world}-s{seed}-{int(time.time())}"
    sets = [f"seed={seed}", f"iterations={iterations}", "eval.before_training=true",
            f"storage.root={root}", "cluster.dashboard=false"]
    if world > 1:
        sets += [f"train.world_size={world}", f"cluster.workers.H800={world}"]
    cmd = [str(ROOT / ".venv/bin/rollart"), "train", "--config", CONFIG, "--run-id", run_id,
           *[x for s in sets for x in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    metrics = root / "runs" / run_id / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    evals = [(int(r["iteration"]), r["eval/success_rate"]) for r in rows
             if "eval/success_rate" in r]
    train = [r for r in rows if r["iteration"] >= 0]
    out = {"world_size": world, "seed": seed, "run_id": run_id, "exit": proc.returncode,
           "wall_s": round(wall, 1), "command": " ".join(cmd[1:]),
           "eval_curve": evals,
           "accuracy_before": evals[0][1] if evals and evals[0][0] == -1 else None,
           "accuracy_after": evals[-1][1] if evals and evals[-1][0] >= 0 else None,
           "reward_curve": [round(r["reward/mean"], 4) for r in train if "reward/mean" in r],
           "iteration_s": [round(r["perf/iteration_s"], 2) for r in train],
           "update_s": [round(r.get("perf/update_s", 0.0), 2) for r in train]}
    if proc.returncode:
        out["error"] = proc.stderr[-3000:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--root", default=str(ROOT / "artifacts" / "sharded-learning"))
    ap.add_argument("--out", default=str(ROOT / "results" / "sharded_learning.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the runs of other world sizes or seeds already in --out")
    a = ap.parse_args()
    if not Path(os.path.expanduser("~/.cache/rollart/models/smollm2-135m-instruct")).is_dir():
        print("run `rollart models fetch smollm2-135m-instruct` first")
        return 2
    runs = [one_run(w, s, a.iterations, Path(a.root)) for s in a.seeds for w in a.worlds]
    if a.merge and Path(a.out).exists():
        fresh = {(r["world_size"], r["seed"]) for r in runs}
        runs = [r for r in json.loads(Path(a.out).read_text())["runs"]
                if (r["world_size"], r["seed"]) not in fresh] + runs
        a.worlds = sorted({r["world_size"] for r in runs})

    def gain(w: int) -> list[float]:
        return [r["accuracy_after"] - r["accuracy_before"] for r in runs
                if r["world_size"] == w and r["accuracy_after"] is not None
                and r["accuracy_before"] is not None]

    summary = {f"accuracy_gain_{w}": gain(w) for w in a.worlds}
    summary.update({f"median_iteration_s_{w}": statistics.median(
        x for r in runs if r["world_size"] == w for x in r["iteration_s"][1:] or [0.0])
        for w in a.worlds})
    res = {"benchmark": "sharded_learning", "config": CONFIG, "host": _host(),
           "iterations": a.iterations, "summary": summary, "runs": runs}
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    line = ", ".join(f"{w} rank(s): accuracy " + "; ".join(
        f"{r['accuracy_before']} -> {r['accuracy_after']}" for r in runs
        if r["world_size"] == w) for w in a.worlds)
    print(f"sharded_learning: {line} -> {a.out}")
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
