"""Sharded trainer on SmolLM2-135M-Instruct (float32): parity, memory per rank, resume across
world sizes. Writes results/sharded_trainer.json and prints one summary line.

    .venv/bin/python benchmarks/sharded_trainer.py [--repeats 2] [--rows 16] [--updates 3]

Every run is `rollart.train.rank_check`: N local processes, one trainer rank each, meeting over
gloo, each building the model from the local directory and the same batch (rows of two
generated turns, prompts shared by groups of 4, behaviour log-probs from the start policy plus
noise), then running the trainer's own update.

- update_parity_max_abs: the largest parameter difference after `updates` updates, 2 ranks
  against 1. Bound, from the arithmetic: the runs sum the same float32 terms in another order;
  AdamW moves an element by lr * m_hat / (sqrt(v_hat) + eps) with |m_hat / sqrt(v_hat)| <=
  1.003 over the first 3 steps (Cauchy-Schwarz over the bias-corrected averages), so even a
  gradient element whose sign flips under reordering moves the two runs apart by at most
  2 * 1.003 * lr per step: 6.0e-5 for 3 updates at lr 1e-5.
- state_bytes_per_rank_ratio_{2,4}: parameters + gradients + optimizer state that one rank
  holds, counted from its own tensors, over one rank's alone (and each rank's peak RSS, which
  includes loading the full model before sharding it).
- resume_exact_{1,3}: 2 ranks save after update 2 (torch.distributed.checkpoint, safetensors
  shards) into a run store and run update 3; 1 rank and 3 ranks resume from that checkpoint and
  run update 3: weights within one step's bound (2 * 1.003 * lr) of the straight run.

Sharded ranks build the model on the meta device and read only their shards from the model
directory (one rank loads it whole), so peak RSS shows what sharding saves per process.
`other_benchmarks` repeats, with their files, the two figures measured elsewhere: the weight
sync's growth from 1 to 4 engine hosts (benchmarks/weight_sync.py) and the lost trainer rank
(benchmarks/chaos.py --scenario trainer_rank).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollart.train.rank_check import launch  # noqa: E402

MODEL = Path("~/.cache/rollart/models/smollm2-135m-instruct").expanduser()
ADAM_RATIO = 1.003  # max |m_hat / sqrt(v_hat)| over the first 3 AdamW steps (docstring)


def _params(d: Path) -> dict:
    return safetensors.torch.load_file(str(d / "params.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _ranks(d: Path, world: int) -> list[dict]:
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]


def _host() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "nproc": len(__import__("os").sched_getaffinity(0)),
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def one_repeat(tmp: Path, kw: dict) -> dict:
    runs = {}
    for world in (1, 2, 4):
        t0 = time.perf_counter()
        extra = {"store": str(tmp / "store"), "save_at": 2} if world == 2 else {}
        launch(world, tmp / f"w{world}", **kw, **extra)
        runs[world] = time.perf_counter() - t0
    for world in (1, 3):
        launch(world, tmp / f"resumed{world}", store=str(tmp / "store"), resume_from=2, **kw)
    one = _ranks(tmp / "w1", 1)[0]
    out: dict = {"wall_s": runs}
    base = _params(tmp / "w1")
    out["update_parity_max_abs"] = _max_diff(base, _params(tmp / "w2"))
    out["update_parity_max_abs_4"] = _max_diff(base, _params(tmp / "w4"))
    for world in (2, 4):
        ranks = _ranks(tmp / f"w{world}", world)
        out[f"state_bytes_per_rank_ratio_{world}"] = max(
            r["held_bytes"]["total"] for r in ranks) / one["held_bytes"]["total"]
        out[f"held_bytes_{world}"] = [r["held_bytes"] for r in ranks]
        out[f"peak_rss_mb_{world}"] = [round(r["peak_rss"] / 2**20) for r in ranks]
    out["held_bytes_1"] = one["held_bytes"]
    out["peak_rss_mb_1"] = round(one["peak_rss"] / 2**20)
    straight = _params(tmp / "w2")
    for world in (1, 3):
        d = _max_diff(straight, _params(tmp / f"resumed{world}"))
        out[f"resume_max_abs_{world}"] = d
        out[f"resume_exact_{world}"] = d <= 2 * ADAM_RATIO * kw["lr"]
    for world in (1, 2, 4):
        m = json.loads((tmp / f"w{world}" / "metrics.json").read_text())
        out[f"update_s_{world}"] = m["update_s"]
        out[f"grad_norm_{world}"] = [x["train/grad_norm"] for x in m["metrics"]]
    return out


def other_benchmarks() -> dict:
    """The sync and rank-loss figures as their own result files hold them (commit, date)."""
    out: dict = {}
    sync = ROOT / "results" / "weight_sync.json"
    if sync.exists():
        r = json.loads(sync.read_text())
        out["sync_growth_1_to_4_engines"] = {
            "file": "results/weight_sync.json", "commit": r["host"].get("git_commit"),
            "date": r["host"].get("date"),
            "chain_links_capped": r.get("summary_link_capped", {}).get(
                "sync_growth_1_to_4_engines_chain"),
            "chain_uncapped": r["summary"].get("sync_growth_1_to_4_engines_chain"),
            "star_links_capped": r.get("summary_link_capped", {}).get(
                "sync_growth_1_to_4_engines_star"),
            "link_mbit": r.get("link_mbit")}
    chaos = ROOT / "results" / "chaos_trainer_rank.json"
    if chaos.exists():
        r = json.loads(chaos.read_text())
        faults = [f for f in r["faults"] if f["kind"] == "trainer_rank_kill"]
        out["trainer_rank_loss_recovered"] = {
            "file": "results/chaos_trainer_rank.json", "commits": r["commits"],
            "value": bool(faults) and all(f["recovered"] for f in faults) and r["completed"]
            and r["duplicated"] == 0 and r["unaccounted"] == 0,
            "faults": faults}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--out", default=str(ROOT / "results" / "sharded_trainer.json"))
    a = ap.parse_args()
    if not Path(a.model).is_dir():
        print(f"no model at {a.model}: run `rollart models fetch smollm2-135m-instruct`")
        return 2
    kw = dict(model=a.model, updates=a.updates, rows=a.rows, lr=a.lr, micro=4, max_len=120,
              seed=0)
    repeats = []
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix=f"rollart-sharded-{i}-") as tmp:
            repeats.append(one_repeat(Path(tmp), kw))
    bound = 2 * ADAM_RATIO * a.lr * a.updates

    def spread(key: str) -> dict:
        vals = [r[key] for r in repeats]
        return {"min": min(vals), "median": statistics.median(vals), "max": max(vals),
                "per_repeat": vals}

    head = {
        "update_parity_max_abs": max(r["update_parity_max_abs"] for r in repeats),
        "update_parity_bound": bound,
        "state_bytes_per_rank_ratio_2": max(r["state_bytes_per_rank_ratio_2"] for r in repeats),
        "state_bytes_per_rank_ratio_4": max(r["state_bytes_per_rank_ratio_4"] for r in repeats),
        "resume_exact": all(r["resume_exact_1"] and r["resume_exact_3"] for r in repeats),
    }
    res = {"benchmark": "sharded_trainer", "model": a.model, "settings": {**kw, "lr": a.lr},
           "host": _host(), "headline": head, "other_benchmarks": other_benchmarks(),
           "spread": {k: spread(k) for k in ("update_parity_max_abs",
                                             "state_bytes_per_rank_ratio_2",
                                             "state_bytes_per_rank_ratio_4",
                                             "resume_max_abs_1", "resume_max_abs_3")},
           "repeats": repeats}
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"sharded_trainer: parity {head['update_parity_max_abs']:.2e} (bound {bound:.1e}), "
          f"state per rank {head['state_bytes_per_rank_ratio_2']:.3f} (2) "
          f"{head['state_bytes_per_rank_ratio_4']:.3f} (4), resume exact "
          f"{head['resume_exact']} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
