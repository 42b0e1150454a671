"""The first optimizer step on weights mapped from the file against weights the process owns.

`AutoModelForCausalLM.from_pretrained` leaves an HF directory's weights in a private
(copy-on-write) map of `model.safetensors`; the first in-place write to each page copies it
(a fault, and a TLB flush on every core the process runs on). `rollart.models.policy
.load_policy` gives the parameters memory of their own (`own_weights`). Each round loads
SmolLM2-135M-Instruct both ways, each in a fresh process with the trainer worker's malloc
settings (infra/dask_cluster.WORKER_ENVIRON) and 2 torch threads, gives every parameter a
gradient and times fused AdamW's first and second steps. Rounds alternate the order.

    rollart models fetch smollm2-135m-instruct
    .venv/bin/python benchmarks/owned_weights.py --rounds 5

Writes results/owned_weights.json and prints one summary line. Absolute seconds are examples
from one host; the ratio is measured side by side.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = Path("~/.cache/rollart/models/smollm2-135m-instruct").expanduser()


def child(variant: str, model_dir: str) -> dict[str, float]:
    """In this process: load the model `variant`'s way, then two timed AdamW steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.config import ModelConfig
    from rollart.models.policy import load_policy

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    if variant == "owned":
        model, _ = load_policy(ModelConfig(source="hf_dir", path=model_dir), None, 0)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     local_files_only=True)
    load_s = time.perf_counter() - t0
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = torch.optim.AdamW(params, lr=2e-5, fused=True)
    steps = []
    for _ in range(2):
        t0 = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t0)
    return {"load_s": load_s, "first_step_s": steps[0], "second_step_s": steps[1]}


def in_fresh_process(script: str, *args: str) -> dict[str, Any]:
    """`python script ARGS` in a fresh process with the workers' malloc settings
    (infra/dask_cluster.WORKER_ENVIRON); the JSON object its last line of output prints."""
    from infra.dask_cluster import WORKER_ENVIRON

    env = {**os.environ, **{k: str(v) for k, v in WORKER_ENVIRON.items()},
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(variant: str, model_dir: str) -> dict[str, float]:
    return in_fresh_process(__file__, "--child", variant, "--model", model_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--child", choices=["mapped", "owned"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results/owned_weights.json"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model)))
        return
    if not Path(a.model).is_dir():
        sys.exit(f"{a.model} is not a model directory: run `rollart models fetch "
                 "smollm2-135m-instruct` first")
    from benchmarks.agentic_results import host_facts

    host = host_facts()
    runs: dict[str, list[dict[str, float]]] = {"mapped": [], "owned": []}
    for r in range(a.rounds):
        order = ["mapped", "owned"] if r % 2 == 0 else ["owned", "mapped"]
        for variant in order:
            runs[variant].append(run_child(variant, a.model))
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items()}

    def total(x: dict[str, float]) -> float:  # what a run pays: the load and the first step
        return x["load_s"] + x["first_step_s"]

    out: dict[str, Any] = {
        "benchmark": "owned_weights", "command": " ".join([sys.executable, *sys.argv]),
        "host": {**host, "loadavg_end": Path("/proc/loadavg").read_text().split()[:3]},
        "model": "SmolLM2-135M-Instruct (float32)", "rounds": a.rounds, "median": med,
        "first_step_ratio": med["mapped"]["first_step_s"] / med["owned"]["first_step_s"],
        "first_step_ratio_per_round": [m["first_step_s"] / o["first_step_s"] for m, o in
                                       zip(runs["mapped"], runs["owned"], strict=True)],
        "load_and_first_step_saved_s_per_round": [total(m) - total(o) for m, o in
                                                  zip(runs["mapped"], runs["owned"],
                                                      strict=True)],
        "runs": runs,
        "note": "absolute seconds are examples from one host; each round runs both variants "
                "side by side, alternating which goes first",
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    saved = out["load_and_first_step_saved_s_per_round"]
    print(f"owned_weights: first AdamW step {med['mapped']['first_step_s']:.2f} s mapped vs "
          f"{med['owned']['first_step_s']:.2f} s owned ({out['first_step_ratio']:.1f}x); load + "
          f"first step {min(saved):.2f}-{max(saved):.2f} s less per round -> {a.out}")


if __name__ == "__main__":
    main()
