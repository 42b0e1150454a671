"""Where an iteration of the embedded default goes: stage work vs orchestration.

Runs the default config (`configs/default.yaml`) for `--iterations` iterations through
- `threads`: the Prefect flow, stage tasks on a thread pool in the flow process, each stage a raw
  Dask task on a worker of its class (`cluster.task_runner: threads`, the default);
- `dask`: the Prefect flow with Prefect's DaskTaskRunner (`cluster.task_runner: dask`);
- `in-process`: the same driver with plain calls (no Prefect, no Dask, rewards scored in the
  rollout service instead of the Lambda endpoint; reference),
interleaved over `--repeats`, each run in a fresh process, against one standalone Prefect server.

Every stage records its own span where it ran (`rollart/runner/spans.py`); the driver splits each
iteration into stage work (the union of the spans) and orchestration (the rest: Prefect task
submission and state tracking, Dask scheduling, actor round trips, serialisation):
`perf/orchestration_s`, `perf/orchestration_share`. The first iteration (cluster warm-up, first
weight sync, first forward passes) is reported but left out of the shares.

    .venv/bin/python benchmarks/control_plane.py            # -> results/control_plane.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("threads", "dask", "in-process")
STAGES = ("collect", "score", "update", "sync_weights", "checkpoint", "evaluate")


def child(variant: str, iterations: int, root: str) -> None:
    """One run; prints its metrics rows as JSON on the last line."""
    sys.path.insert(0, str(ROOT))
    from rollart.config import load_config
    from rollart.storage.store import RunStore

    overrides = [f"iterations={iterations}", f"storage.root={root}", "cluster.dashboard=false"]
    run_id = f"cp-{variant}-{int(time.time() * 1000)}"
    t0 = time.perf_counter()
    if variant == "in-process":
        from rollart.runner.local_loop import run_local

        # no Lambda endpoint in-process (the flow starts it): rewards scored in the service
        run_local(load_config(ROOT / "configs/default.yaml",
                              [*overrides, "reward.backend=local"]), run_id)
    else:
        from flows.train import train

        train(config=str(ROOT / "configs/default.yaml"), run_id=run_id,
              overrides=[*overrides, f"cluster.task_runner={variant}"])
    wall = time.perf_counter() - t0
    rows = RunStore(root, run_id).read_jsonl("metrics.jsonl")
    print(json.dumps({"variant": variant, "wall_s": wall, "rows": rows}))


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    it = sum(r["perf/iteration_s"] for r in steady)
    orch = sum(r["perf/orchestration_s"] for r in steady)
    return {
        "iterations": len(rows),
        "iteration_s_median": statistics.median(r["perf/iteration_s"] for r in steady),
        "orchestration_s_median": statistics.median(r["perf/orchestration_s"] for r in steady),
        "orchestration_share": orch / it,
        "first_iteration_s": rows[0]["perf/iteration_s"],
        "first_orchestration_share": rows[0]["perf/orchestration_share"],
        "stage_s_median": {
            s: statistics.median(v) for s in STAGES
            if (v := [r[f"perf/stage/{s}_s"] for r in steady if f"perf/stage/{s}_s" in r])},
        "update_tokens_per_s_median": statistics.median(
            r["perf/update_tokens_per_s"] for r in steady) if "perf/update_tokens_per_s"
        in steady[0] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "results/control_plane.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.iterations, a.root)
        return

    from infra.prefect_server import free_port, start_server

    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="rollart-cp-") as tmp:
        server = start_server(state_dir=Path(tmp) / "prefect", port=free_port())
        env = {**os.environ, **server.client_env()}
        try:
            for rep in range(a.repeats):
                for v in variants:  # interleaved: load drifts affect every variant alike
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", v, "--iterations",
                         str(a.iterations), "--root", str(Path(tmp) / "store")],
                        env=env, cwd=ROOT, capture_output=True, text=True, check=False)
                    if out.returncode != 0:
                        sys.exit(f"{v} (repeat {rep}) failed:\n{out.stderr[-3000:]}")
                    res = json.loads(out.stdout.strip().splitlines()[-1])
                    runs[v].append({"wall_s": res["wall_s"], **summarise(res["rows"])})
                    print(f"repeat {rep} {v}: {runs[v][-1]['iteration_s_median']:.2f} s/it, "
                          f"orchestration {runs[v][-1]['orchestration_share']:.3f}", flush=True)
        finally:
            server.stop()

    by_variant = {v: {
        "runs": rs,
        "orchestration_share": statistics.median(r["orchestration_share"] for r in rs),
        "orchestration_share_max": max(r["orchestration_share"] for r in rs),
        "iteration_s_median": statistics.median(r["iteration_s_median"] for r in rs),
    } for v, rs in runs.items()}
    default = "threads" if "threads" in by_variant else variants[0]
    result = {
        "benchmark": "control_plane",
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "config": "configs/default.yaml",
        "iterations": a.iterations,
        "repeats": a.repeats,
        "default_task_runner": default,
        # the default config's share (worst repeat: a result must survive a re-run)
        "orchestration_share": by_variant[default]["orchestration_share_max"],
        "variants": by_variant,
        "machine": {"cpus": os.cpu_count()},
        "note": "absolute seconds are examples from one machine; shares and ratios are the result",
    }
    if "dask" in by_variant and "threads" in by_variant:
        result["dask_over_threads_iteration_s"] = (by_variant["dask"]["iteration_s_median"]
                                                   / by_variant["threads"]["iteration_s_median"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2, sort_keys=True))
    print(f"control_plane: orchestration_share={result['orchestration_share']:.3f} (threads, max "
          f"of {a.repeats}) " + " ".join(
              f"{v}={b['iteration_s_median']:.2f}s/it@{b['orchestration_share']:.3f}"
              for v, b in by_variant.items()))


if __name__ == "__main__":
    main()
