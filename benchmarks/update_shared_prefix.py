"""Policy update with and without the shared-prefix forward, on SmolLM2-135M (float32).

The batch has the shape of `benchmarks/vs_trl.py`: `--groups` prompts x `--group` samples of the
arithmetic task's real prompt (chat template, 45 tokens) and answers of 30-64 random tokens.
`Trainer.update` runs alternately with `train.shared_prefix` off and on (same model state,
same batch; `--repeats` rounds after one warm-up each), so both see the same machine load;
`speedup` is the median of the per-round ratios. Writes results/update_shared_prefix.json and
prints one summary line.

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
    trainers = {on: Trainer(copy.deepcopy(model), algo, TrainConfig(
        lr=3e-5, epochs=1, micro_batch_size=len(trajs), threads=a.threads, shared_prefix=on))
        for on in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens = sum(len(t.token_ids) for t in trajs)
    for r in range(a.repeats + 1):
        for on, tr in trainers.items():
            t0 = time.perf_counter()
            tr.update(trajs)
            if r:  # round 0 warms both up
                times[on].append(time.perf_counter() - t0)
    ratios = [p / s for p, s in zip(times[False], times[True], strict=True)]
    res = {"benchmark": "update_shared_prefix", "args": vars(a), "tokens": tokens,
           "plain_s": times[False], "shared_s": times[True],
           "plain_median_s": statistics.median(times[False]),
           "shared_median_s": statistics.median(times[True]),
           "speedup": statistics.median(ratios), "speedup_min": min(ratios),
           "speedup_max": max(ratios)}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"update_shared_prefix: {res['plain_median_s']:.1f} s -> {res['shared_median_s']:.1f} s"
          f" per update of {len(trajs)} sequences ({tokens} tokens): {res['speedup']:.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) -> {a.out}")


if __name__ == "__main__":
    main()
