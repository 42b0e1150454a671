"""Policy update with and without the shared-prefix forward, on SmolLM2-135M (float32).

The batch has the shape of `benchmarks/vs_trl.py`: `--groups` prompts x `--group` samples of the
arithmetic task's real prompt (chat template, 45 tokens) and answers of 30-64 random tokens.
`Trainer.update` runs alternately with `train.shared_prefix` off, on with every suffix in one
call (`one_call`: the suffixes padded to the longest answer), and on as configured (suffixes in
length buckets, `rollart.train.shared_prefix.suffix_buckets`), same model state, same batch,
`--repeats` rounds after one warm-up each, so all see the same machine load; `speedup` (plain
over shared) and `bucket_speedup` (one call over buckets) are medians of per-round ratios.
Writes results/update_shared_prefix.json and prints one summary line.

    .venv/bin/python benchmarks/update_shared_prefix.py
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollart.config import AlgoConfig, ModelConfig, TrainConfig, load_config  # noqa: E402
from rollart.envs import make_env  # noqa: E402
from rollart.models.fetch import fetch_model  # noqa: E402
from rollart.models.policy import load_policy  # noqa: E402
from rollart.train import shared_prefix  # noqa: E402
from rollart.train.trainer import Trainer  # noqa: E402
from rollart.types import Trajectory  # noqa: E402


def batch(tok, env, groups: int, group: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        problem, _ = env.generate(g)
        msgs = [{"role": "system", "content": env.system_prompt},
                {"role": "user", "content": f"Compute {problem}."}]
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        for k in range(group):
            ans = [rng.randrange(100, 40000) for _ in range(rng.randint(30, 64))]
            ids = prompt + ans
            out.append(Trajectory(
                sample_id=f"{g}/{k}", task="arith", env_id="arith", group_id=str(g), seed=g,
                iteration=0, token_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(ans),
                behaviour_logprobs=[0.0] * len(prompt) + [-3.0] * len(ans),
                token_versions=[0] * len(ids), advantage=1.0 if k % 2 else -1.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results/update_shared_prefix.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = fetch_model("smollm2-135m-instruct")["path"]
    model, tok = load_policy(ModelConfig(source="hf_dir", path=path), None, 0)
    env = make_env(load_config(ROOT / "configs/smollm2-arith.yaml").tasks[0])
    trajs = batch(tok, env, a.groups, a.group)
    algo = AlgoConfig(loss="ppo_clip", entropy_coef=0.0, off_policy="tis")
    variants = {"plain": False, "one_call": True, "shared": True}
    trainers = {v: Trainer(copy.deepcopy(model), algo, TrainConfig(
        lr=3e-5, epochs=1, micro_batch_size=len(trajs), threads=a.threads, shared_prefix=on))
        for v, on in variants.items()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    tokens = sum(len(t.token_ids) for t in trajs)
    buckets = shared_prefix.MAX_BUCKETS
    for r in range(a.repeats + 1):
        for v, tr in trainers.items():
            shared_prefix.MAX_BUCKETS = 1 if v == "one_call" else buckets
            t0 = time.perf_counter()
            tr.update(trajs)
            if r:  # round 0 warms every variant up
                times[v].append(time.perf_counter() - t0)
    shared_prefix.MAX_BUCKETS = buckets
    ratios = [p / s for p, s in zip(times["plain"], times["shared"], strict=True)]
    bucket = [o / s for o, s in zip(times["one_call"], times["shared"], strict=True)]
    res = {"benchmark": "update_shared_prefix", "args": vars(a), "commit": _commit(),
           "tokens": tokens, "plain_s": times["plain"], "one_call_s": times["one_call"],
           "shared_s": times["shared"],
           "plain_median_s": statistics.median(times["plain"]),
           "one_call_median_s": statistics.median(times["one_call"]),
           "shared_median_s": statistics.median(times["shared"]),
           "speedup": statistics.median(ratios), "speedup_min": min(ratios),
           "speedup_max": max(ratios), "bucket_speedup": statistics.median(bucket),
           "bucket_speedup_min": min(bucket), "bucket_speedup_max": max(bucket)}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"update_shared_prefix: {res['plain_median_s']:.1f} s plain, "
          f"{res['one_call_median_s']:.1f} s shared prefix in one call, "
          f"{res['shared_median_s']:.1f} s with length buckets per update of {len(trajs)} "
          f"sequences ({tokens} tokens): {res['speedup']:.2f}x (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}), buckets {res['bucket_speedup']:.2f}x -> {a.out}")


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
