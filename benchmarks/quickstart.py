"""What a new user measures: a fresh clone, `make venv`, then `make train`.

Clones this repository's HEAD into a temporary directory, times the set-up (`make venv`) and
the training run (`make train`) separately, and timestamps every progress row `make train`
prints, so `time_to_0_9_s` is the time from the start of `make train` (venv present) to the
first greedy evaluation >= 0.9. Stops the clone's Prefect server afterwards (`make down`).
Needs port 4200 free (the README's server); run it on an otherwise idle machine.

    .venv/bin/python benchmarks/quickstart.py          # -> results/quickstart.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s*(\d+)/(\d+)\s")  # a progress row starts with "  k/total"


def parse_rows(lines: list[tuple[float, str]]) -> list[tuple[float, dict[str, str]]]:
    """The terminal table `rollart train` prints (rollart/progress.py: TerminalTable): a header,
    then rows of right-aligned cells 8 wide, 2 apart (an empty cell when not measured)."""
    header = next((line.split() for _, line in lines
                   if line.split()[:2] == ["iter", "reward"]), None)
    if header is None:
        return []
    return [(t, {c: line[10 * i:10 * i + 8].strip() for i, c in enumerate(header)})
            for t, line in lines if ROW.match(line)]


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def timed_make(clone: Path, target: str, args: str = "") -> tuple[float, list[tuple[float, str]]]:
    """Run `make target`, return (seconds, [(seconds since start, line)])."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "VIRTUAL_ENV"))}
    t0 = time.perf_counter()
    proc = subprocess.Popen(["make", target, *([f"ARGS={args}"] if args else [])], cwd=clone,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.perf_counter() - t0, line.rstrip("\n")))
    if proc.wait() != 0:
        tail = "\n".join(line for _, line in lines[-40:])
        sys.exit(f"make {target} failed:\n{tail}")
    return time.perf_counter() - t0, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--args", default="", help="ARGS for make train (default: none, as a user)")
    ap.add_argument("--keep", action="store_true", help="keep the clone")
    ap.add_argument("--out", default=str(ROOT / "results/quickstart.json"))
    a = ap.parse_args()
    if port_busy(4200):
        sys.exit("port 4200 is in use (another Prefect server?): stop it first (make down)")
    tmp = Path(tempfile.mkdtemp(prefix="rollart-quickstart-"))
    clone = tmp / "rollart"
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, check=True,
                                capture_output=True, text=True).stdout.strip()
        setup_s, setup_lines = timed_make(clone, "venv")
        train_s, lines = timed_make(clone, "train", a.args)
        subprocess.run(["make", "down"], cwd=clone, capture_output=True, check=False)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = parse_rows(lines)
    evals = [(t, int(r["iter"].split("/")[0]), float(r["eval"])) for t, r in rows if r["eval"]]
    hit = next(((t, it) for t, it, e in evals if e >= 0.9), None)
    result = {
        "benchmark": "quickstart",
        "commit": commit,
        "args": a.args,
        "setup_s": setup_s,
        "train_s": train_s,
        "time_to_0_9_s": hit[0] if hit else None,
        "iteration_at_0_9": hit[1] if hit else None,
        "evals": [{"s": t, "iteration": it, "eval": e} for t, it, e in evals],
        "final_eval": evals[-1][2] if evals else None,
        "iterations": len(rows),
        "setup_error_lines": [line for _, line in setup_lines if "ERROR" in line],
        "train_warning_lines": [line for _, line in lines
                                if re.search(r"\b(WARNING|ERROR|Traceback)\b", line)][:20],
        "machine": {"cpus": os.cpu_count()},
        "note": "absolute seconds are examples from one machine (this machine kind varies ~2x)",
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"quickstart: setup_s={setup_s:.0f} train_s={train_s:.0f} "
          f"time_to_0_9_s={result['time_to_0_9_s'] and round(result['time_to_0_9_s'])} "
          f"final_eval={result['final_eval']} iterations={result['iterations']}")


if __name__ == "__main__":
    main()
