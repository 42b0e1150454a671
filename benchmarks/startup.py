"""Start-up of `rollart train`: seconds from the command to its first iteration, this checkout
against a baseline checkout (another commit), alternating runs in one invocation.

    git worktree add /tmp/rollart-base <commit>
    .venv/bin/python benchmarks/startup.py --baseline /tmp/rollart-base --rounds 3 \\
        [--config configs/smollm2-guess.yaml --set engine.backend=vllm ...]

Each run is `rollart train --set iterations=1` (plus `--set`s) with this venv and the code of
its checkout (PYTHONPATH; configs are read from the checkout), its store in a temporary
directory. One unrecorded run first starts the Prefect server, which the later runs reuse as a
user's later runs do. Rounds alternate the order (AB, BA, ...) so drift on the host cancels.

    startup_s  command start -> first progress row, less that row's iter_s (the first iteration)
    finish_s   first progress row -> the command's exit (final checkpoint upload, shutdown)

Writes results/startup.json and prints one summary line. Absolute seconds are examples from
one host; compare the two checkouts through the ratios, measured side by side.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agentic_results import host_facts  # noqa: E402
from benchmarks.quickstart import parse_rows  # noqa: E402


def timed_train(checkout: Path, config: str, sets: list[str], run_id: str,
                store: Path) -> dict[str, Any]:
    """One `rollart train` of `checkout`'s code: its start-up, first iteration and finish."""
    cmd = [str(ROOT / ".venv/bin/rollart"), "train", "--config", config, "--run-id", run_id]
    for s in ["iterations=1", f"storage.root={store}", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in proc.stdout]
    wall = time.perf_counter() - t0
    rows = parse_rows(lines)
    if proc.wait() != 0 or not rows:
        tail = "\n".join(line for _, line in lines[-30:])
        sys.exit(f"{run_id} failed (exit {proc.returncode}):\n{tail}")
    first_row_s, row = rows[0]
    iter_s = float(row["iter_s"])
    return {"run_id": run_id, "wall_s": wall, "first_row_s": first_row_s,
            "first_iteration_s": iter_s, "startup_s": first_row_s - iter_s,
            "finish_s": wall - first_row_s}


def commit_of(checkout: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True,
                              text=True).stdout.strip()

    return {"path": str(checkout), "commit": git("rev-parse", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per checkout, and baseline / this for each round (how much faster this is)."""
    med = {v: {k: statistics.median(r[k] for r in rs)
               for k in ("startup_s", "finish_s", "wall_s", "first_iteration_s")}
           for v, rs in runs.items()}
    per_round = [b["startup_s"] / n["startup_s"]
                 for b, n in zip(runs["baseline"], runs["this"], strict=True)]
    return {"median": med, "startup_speedup": med["baseline"]["startup_s"]
            / med["this"]["startup_s"], "startup_speedup_per_round": per_round,
            "startup_saved_s": med["baseline"]["startup_s"] - med["this"]["startup_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, type=Path,
                    help="a checkout of the commit to compare with (git worktree add DIR REV)")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="override for both (repeatable), as rollart train --set")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results/startup.json"))
    a = ap.parse_args()
    checkouts = {"baseline": a.baseline.resolve(), "this": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    host = host_facts()
    commits = {v: commit_of(p) for v, p in checkouts.items()}  # before the runs: what ran
    with tempfile.TemporaryDirectory(prefix="rollart-startup-") as tmp:
        timed_train(ROOT, a.config, a.sets, f"startup-warmup-{int(time.time())}",
                    Path(tmp) / "warmup")  # starts the Prefect server for the rest
        for k in range(a.rounds):
            order = ["baseline", "this"] if k % 2 == 0 else ["this", "baseline"]
            for v in order:
                run_id = f"startup-{v}-{k}-{int(time.time())}"
                res = timed_train(checkouts[v], a.config, a.sets, run_id, Path(tmp) / run_id)
                runs[v].append(res)
                print(f"round {k} {v}: start-up {res['startup_s']:.1f} s, first iteration "
                      f"{res['first_iteration_s']:.1f} s, finish {res['finish_s']:.1f} s",
                      flush=True)
    host["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    result = {"benchmark": "startup", "command": " ".join(sys.argv), "host": host,
              "config": a.config, "sets": a.sets, "rounds": a.rounds,
              "checkouts": commits,
              **summarise(runs), "runs": runs,
              "note": "absolute seconds are examples from one host (this machine kind varies "
                      "~2x); the checkouts ran alternately in one invocation"}
    out = Path(a.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    m = result["median"]
    print(f"startup: {m['baseline']['startup_s']:.1f} s -> {m['this']['startup_s']:.1f} s "
          f"(median of {a.rounds}; {result['startup_speedup']:.2f}x, rounds "
          f"{min(result['startup_speedup_per_round']):.2f}-"
          f"{max(result['startup_speedup_per_round']):.2f}x) -> {out}")


if __name__ == "__main__":
    main()
