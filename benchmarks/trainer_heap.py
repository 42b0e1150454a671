"""SmolLM2-135M trainer updates in a Dask worker, with glibc's default heap policy and with
rollart's (infra/dask_cluster.WORKER_ENVIRON: freed memory stays in the process).

A multi-turn update on SmolLM2-135M peaks at ~6 GB (weights, gradients, Adam state, the
activations of 8 conversations of ~300 tokens). glibc returns freed memory to the OS (heap top
above its trim threshold, chunks it mmapped), so an update re-faults memory the previous one
freed; on the 2-core VMs here a page fault costs ~10-20 us of system time, and the first
updates of a fresh worker ran twice as long as later ones. Each variant spawns an H800-class
worker with its environment and runs `--updates` updates of the same synthetic batches
(random tokens shaped like the guess task's episodes: 3-6 turns of 30-45 observation tokens
and 3-24 model tokens) through `Trainer.update` in the worker's task thread, as the trainer
service does. Variants alternate within one invocation, so their ratios compare.

    .venv/bin/python benchmarks/trainer_heap.py [--updates 6] [--rounds 1]

Writes results/trainer_heap.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = Path.home() / ".cache/rollart/models/smollm2-135m-instruct"


def synthetic_trainer(threads: int) -> tuple[Any, Callable[[int], list]]:
    """A SmolLM2-135M Trainer as the benchmark config builds it, and `batch(it)`: 8 synthetic
    episodes of step `it` (random tokens shaped like the guess task's episodes)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from rollart.config import AlgoConfig, TrainConfig
    from rollart.train.trainer import Trainer
    from rollart.types import Trajectory

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    trainer = Trainer(model, AlgoConfig(loss_agg="seq_mean_token_mean"),
                      TrainConfig(lr=2e-5, epochs=1, micro_batch_size=8), temperature=0.7,
                      pad_id=2)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(60)]

    def episode(i: int, it: int) -> Trajectory:
        ids, mask = list(prompt), [0] * len(prompt)
        for _ in range(rng.randint(3, 6)):
            obs = [rng.randrange(100, 40000) for _ in range(rng.randint(30, 45))]
            out = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 24))]
            ids += obs + out
            mask += [0] * len(obs) + [1] * len(out)
        return Trajectory(
            sample_id=f"s{it}-{i}", task="guess", env_id="guess", group_id=f"g{i // 4}",
            seed=i, iteration=it, token_ids=ids, loss_mask=mask,
            behaviour_logprobs=[-1.0 if m else 0.0 for m in mask],
            token_versions=[it if m else -1 for m in mask], allowed_token_ids=None,
            advantage=rng.choice([-1.0, 1.0]))

    return trainer, lambda it: [episode(i, it) for i in range(8)]


def updates_in_worker(n: int, threads: int) -> list[dict[str, float]]:
    """`n` updates on fixed synthetic batches; per update: seconds, page faults, system s."""
    import resource

    trainer, batch_of = synthetic_trainer(threads)
    out = []
    for it in range(n):
        batch = batch_of(it)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        trainer.update(batch)
        dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        out.append({"update_s": round(dt, 2), "page_faults": r1.ru_minflt - r0.ru_minflt,
                    "system_s": round(r1.ru_stime - r0.ru_stime, 2),
                    "tokens": sum(len(t.token_ids) for t in batch),
                    "max_rss_mb": r1.ru_maxrss // 1024})
    return out


def summary(runs: list[list[dict[str, float]]]) -> dict[str, float]:
    first = [r[0]["update_s"] + r[1]["update_s"] for r in runs]
    later = [u["update_s"] for r in runs for u in r[2:]]
    return {"first_two_s": round(statistics.mean(first), 2),
            "later_median_s": round(statistics.median(later), 2),
            "total_s": round(statistics.mean(sum(u["update_s"] for u in r) for r in runs), 2),
            "total_s_per_round": [round(sum(u["update_s"] for u in r), 2) for r in runs],
            "first_two_s_per_round": [round(f, 2) for f in first],
            "page_faults": round(statistics.mean(sum(u["page_faults"] for u in r)
                                                 for r in runs)),
            "system_s": round(statistics.mean(sum(u["system_s"] for u in r) for r in runs), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the variants")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results/trainer_heap.json"))
    args = ap.parse_args()
    if not MODEL.exists():
        sys.exit(f"{MODEL} is missing: `rollart models fetch smollm2-135m-instruct`")
    import infra.dask_cluster as dc
    from benchmarks.worker_malloc import in_worker

    keep = dict(dc.WORKER_ENVIRON)
    glibc = {k: v for k, v in keep.items() if not k.startswith("MALLOC_")}
    variants = {"glibc_default": glibc, "rollart": keep}
    runs: dict[str, list] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, env in variants.items():
            runs[name].append(in_worker(env, updates_in_worker, args.updates, args.threads))
            print(name, runs[name][-1], flush=True)
    s = {k: summary(v) for k, v in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "trainer_heap", "command": " ".join([sys.executable, *sys.argv]),
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"cpu": platform.processor() or platform.machine(),
                 "cores": os.cpu_count()},
        "model": "SmolLM2-135M-Instruct (float32)", "updates": args.updates,
        "threads": args.threads, "environ": {k: {e: v for e, v in env.items()
                                                 if e.startswith("MALLOC_")}
                                             for k, env in variants.items()},
        "summary": s, "runs": runs,
        "first_two_ratio": round(s["glibc_default"]["first_two_s"]
                                 / s["rollart"]["first_two_s"], 2),
        "later_ratio": round(s["glibc_default"]["later_median_s"]
                             / s["rollart"]["later_median_s"], 2),
        "total_ratio": round(s["glibc_default"]["total_s"] / s["rollart"]["total_s"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"trainer_heap: glibc default / rollart heap policy: first two updates "
          f"{result['first_two_ratio']}x ({s['glibc_default']['first_two_s']} vs "
          f"{s['rollart']['first_two_s']} s), later {result['later_ratio']}x, all "
          f"{args.updates} {result['total_ratio']}x; page faults "
          f"{s['glibc_default']['page_faults']} vs {s['rollart']['page_faults']} -> {args.out}")


if __name__ == "__main__":
    main()
