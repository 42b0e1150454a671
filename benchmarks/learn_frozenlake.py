"""Does RL learn? Train the tiny policy on FrozenLake and report greedy success on held-out seeds.

Runs the same stage functions the Prefect flow runs (rollart.runner.stages), in one process by
default (`--mode local`, no orchestration overhead), or through the real flow on the embedded Dask
cluster (`--mode flow`, needs PREFECT_API_URL or starts the local server).

Writes results/learn_frozenlake.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollart.config import load_config  # noqa: E402
from rollart.runner.progress import format_row  # noqa: E402

KEEP = ["iteration", "reward/mean", "rollout/success_rate", "rollout/no_action_rate",
        "rollout/episode_len", "train/entropy", "eval/success_rate", "perf/iteration_s",
        "perf/elapsed_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.9, help="stop early once reached 3 times")
    ap.add_argument("--mode", choices=["local", "flow"], default="local")
    ap.add_argument("--out", default="results/learn_frozenlake.json")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rollart-bench-")
    overrides = [f"iterations={args.iterations}", f"eval.every={args.eval_every}",
                 f"storage.root={root}", "storage.save_every=1000", *args.overrides]
    cfg = load_config(args.config, overrides)
    run_id = f"bench-{int(time.time())}"
    t0 = time.perf_counter()
    if args.mode == "local":
        from infra.lambda_endpoint import with_embedded_endpoint
        from rollart.runner.local_loop import run_local

        with contextlib.ExitStack() as stack:
            cfg = with_embedded_endpoint(cfg, stack)
            out = run_local(cfg, run_id, on_iteration=lambda r: print(format_row(r), flush=True),
                            stop_when=lambda ev: len(ev) >= 3 and min(ev[-3:]) >= args.target)
        curve = out["curve"]
    else:
        from cli.main import _ensure_prefect_api

        _ensure_prefect_api()
        from flows.train import train
        from rollart.storage.store import RunStore

        train(config=args.config, overrides=overrides, run_id=run_id)
        curve = RunStore(root, run_id).read_jsonl("metrics.jsonl")
    wall = time.perf_counter() - t0
    evals = [m["eval/success_rate"] for m in curve if "eval/success_rate" in m]
    result = {
        "final_success": evals[-1] if evals else 0.0,
        "stable_success": min(evals[-3:]) if evals else 0.0,  # worst of the last 3 evaluations
        "eval_episodes": cfg.eval.episodes,
        "iterations": len(curve),
        "wall_s": round(wall, 1),
        "mode": args.mode,
        "config": args.config,
        "overrides": args.overrides,
        "curve": [{k: m[k] for k in KEEP if k in m} for m in curve],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"learn_frozenlake: final_success={result['final_success']:.3f} "
          f"stable_success={result['stable_success']:.3f} iterations={result['iterations']} "
          f"wall_s={result['wall_s']} mode={args.mode} -> {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
