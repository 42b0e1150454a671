"""TRL's GRPOTrainer on a problem file written by `benchmarks/vs_trl.py` (the peer side).

Runs in the peer venv (`make peer` -> .venv-peer: torch CPU, trl==1.16.0, math-verify), never in
rollart's own venv. Takes the prompts (already rendered in the policy's chat format, so both
frameworks see the same text) and gold answers from `--data`, trains with plain transformers
generation (TRL's default: no vLLM), one optimizer step per batch, no reference model
(beta 0), a constant learning rate, and scores completions with rollart's own `math` reward
function plus the arithmetic env's format penalty: the same reward rollart's runs get.

Timing (measured only; nothing in TRL is changed): a callback stamps each optimizer step, and
`_generate_and_score_completions` is wrapped to time generation + scoring; training = step -
generation. Writes `--out` (JSON) and saves the final model to `--save`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rollart.rewards.math_reward

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollart.rewards.math_reward import math_answer  # noqa: E402

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def arith_reward(format_penalty: float):
    """rollart's arith env reward: 1 for a verified answer, plus `format_penalty` untagged."""
    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        out = []
        for text, gold in zip(completions, answer, strict=True):
            correct = math_answer({"response": text, "answer": gold})["reward"] > 0
            penalty = 0.0 if _TAGGED.search(text) else format_penalty
            out.append((1.0 if correct else 0.0) + penalty)
        return out
    reward.__name__ = "arith"
    return reward


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.t0 = 0.0
        self.steps: list[float] = []

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        self.steps.append(time.perf_counter() - self.t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="JSON: {train: [{prompt, answer}], ...}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--format-penalty", type=float, default=-0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = json.loads(Path(a.data).read_text())
    rows = data["train"][: a.steps * a.prompts_per_step]
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    batch = a.prompts_per_step * a.group_size
    args = GRPOConfig(
        output_dir=str(Path(a.save) / "trl-out"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=a.group_size,
        max_completion_length=a.max_new_tokens, temperature=a.temperature, top_p=1.0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=a.steps, beta=0.0, num_iterations=1, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=a.seed,
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward(a.format_penalty), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=[clock])
    gen_s: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*args_, **kw):  # noqa: ANN002, ANN003
        t = time.perf_counter()
        out = inner(*args_, **kw)
        gen_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed
    load_s = time.perf_counter() - t_load
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    trainer.save_model(a.save)
    tok.save_pretrained(a.save)
    Path(a.out).write_text(json.dumps({
        "framework": "trl", "trl_version": __import__("trl").__version__,
        "load_s": load_s, "step_s": clock.steps, "generation_s": gen_s,
        "reward": [h["reward"] for h in logs],
        "completion_tokens": [h.get("completions/mean_length", 0.0) * batch for h in logs],
    }, indent=1))


if __name__ == "__main__":
    main()
