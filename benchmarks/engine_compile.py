"""vLLM's CPU engine with its sampler helpers compiled (vLLM's default) against run eagerly.

vLLM compiles two small sampler helpers with inductor even when the model runs eagerly
(`enforce_eager`): on CPU the first call builds C++ and probes the compiler in a subprocess,
and shapes it has not seen compile again. `rollart.engines.vllm_engine.VLLMEngine` sets
torch's compiler stance to eager for its whole process on CPU with `enforce_eager` (the
default there), so they run eagerly. As in a Dask worker, the engine is built on one thread
and generates on another. Each round starts both variants, each in a fresh process with the
engine worker's malloc settings (infra/dask_cluster.WORKER_ENVIRON) and 2 torch threads, and plays
`--steps` steps of a multi-turn workload shaped like the guess game: 8 conversations of a
100-token prompt, 6 turns each of 4 sampled tokens and 34 tokens of observation, the prefix
cache reused between turns, each step after a weight sync (the same weights, written in
place and repacked as in a run). Rounds alternate the order.

    rollart models fetch smollm2-135m-instruct
    .venv/bin/python benchmarks/engine_compile.py --rounds 3

Writes results/engine_compile.json and prints one summary line. Absolute seconds are examples
from one host; the variants are compared side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = Path("~/.cache/rollart/models/smollm2-135m-instruct").expanduser()
VARIANTS = ("compiled", "eager")


def child(variant: str, model_dir: str, steps: int) -> dict[str, Any]:
    """In this process: an engine, then `steps` + 1 steps (the first one before any sync)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.types import GenerationRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, tok, kv_cache_mb=1024)
    init_s = time.perf_counter() - t0
    if variant == "compiled":  # vLLM's own behaviour: undo the engine's eager stance
        torch.compiler.set_stance("default")
    torch.set_num_threads(2)
    state = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True).state_dict().items()}
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    calls = [0]

    def step() -> float:
        convs = [[rng.randrange(100, 40000) for _ in range(100)] for _ in range(8)]
        t = time.perf_counter()
        for _ in range(6):
            calls[0] += 1
            reqs = [GenerationRequest(f"r{calls[0]}-{i}", list(c), params)
                    for i, c in enumerate(convs)]
            for c, out in zip(convs, engine.generate(reqs), strict=True):
                c += out.token_ids + [rng.randrange(100, 40000) for _ in range(34)]
        return time.perf_counter() - t

    def synced_step() -> float:
        engine.update_weights(engine.weight_version + 1, state)
        return step()

    # Another thread than the engine's constructor, as a Dask actor's calls run.
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads,
                            initargs=(2,)) as calls_thread:
        first = calls_thread.submit(step).result()
        later = [calls_thread.submit(synced_step).result() for _ in range(steps)]
    return {"init_s": init_s, "first_step_s": first, "later_steps_s": later,
            "later_median_s": statistics.median(later)}


def run_child(variant: str, model_dir: str, steps: int) -> dict[str, Any]:
    from benchmarks.owned_weights import in_fresh_process

    return in_fresh_process(__file__, "--child", variant, "--model", model_dir,
                            "--steps", str(steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steps after the first, each synced")
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results/engine_compile.json"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.steps)))
        return
    if not Path(a.model).is_dir():
        sys.exit(f"{a.model} is not a model directory: run `rollart models fetch "
                 "smollm2-135m-instruct` first")
    from benchmarks.agentic_results import host_facts

    host = host_facts()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(run_child(variant, a.model, a.steps))
            print(variant, {k: v for k, v in runs[variant][-1].items()
                            if k != "later_steps_s"}, flush=True)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in
               ("init_s", "first_step_s", "later_median_s")} for v, rs in runs.items()}
    c, e = runs["compiled"], runs["eager"]
    out: dict[str, Any] = {
        "benchmark": "engine_compile", "command": " ".join([sys.executable, *sys.argv]),
        "host": {**host, "loadavg_end": Path("/proc/loadavg").read_text().split()[:3]},
        "model": "SmolLM2-135M-Instruct (float32), vLLM CPU engine, enforce_eager",
        "rounds": a.rounds, "steps": a.steps, "median": med,
        "first_step_saved_s_per_round": [x["first_step_s"] - y["first_step_s"]
                                         for x, y in zip(c, e, strict=True)],
        "later_step_ratio_per_round": [x["later_median_s"] / y["later_median_s"]
                                       for x, y in zip(c, e, strict=True)],
        "runs": runs,
        "note": "absolute seconds are examples from one host; each round runs both variants "
                "side by side, alternating which goes first",
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    saved, ratio = out["first_step_saved_s_per_round"], out["later_step_ratio_per_round"]
    print(f"engine_compile: first step {med['compiled']['first_step_s']:.2f} s compiled vs "
          f"{med['eager']['first_step_s']:.2f} s eager ({min(saved):.2f}-{max(saved):.2f} s "
          f"saved per round); later steps compiled/eager {min(ratio):.2f}-{max(ratio):.2f}x "
          f"-> {a.out}")


if __name__ == "__main__":
    main()
