"""TRL 1.16's GRPOTrainer on recorded batches (the peer side of agentic_update_check.py).

Runs in the peer venv (`make peer`). `--batches` (written by the benchmark) holds each step's
episodes in group order (`group_size` consecutive episodes per group): TRL's rollout_func
fields of each (`agentic_episodes.trl_sample`: prompt_ids, completion_ids, env_mask) and its
reward. The rollout_func hands step k's batch to GRPOTrainer instead of generating, so TRL
computes the advantages, the loss and the AdamW step itself, with the very settings of
agentic_vs_trl.py (`peer_trl_agentic.grpo_config`). Writes to `--out` (a directory): the
gradient of step `--grad-step` as the optimizer receives it (after clipping), the weights after
the last step (safetensors) and every step's logged loss and gradient norm (steps.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rollart's pure modules

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from benchmarks.agentic_episodes import Match  # noqa: E402
from benchmarks.peer_trl_agentic import env_outcome_reward, grpo_config  # noqa: E402


class Replay:
    """The rollout_func: step k's recorded batch, whatever the prompts (they only count)."""

    def __init__(self, steps: list[list[dict[str, Any]]]) -> None:
        self.steps, self.k = steps, 0

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        rows = self.steps[self.k]
        self.k += 1
        if len(rows) != len(prompts):
            raise RuntimeError(f"step {self.k}: {len(prompts)} prompts, {len(rows)} episodes")
        return {"prompt_ids": [r["prompt_ids"] for r in rows],
                "completion_ids": [r["completion_ids"] for r in rows],
                "logprobs": None, "env_mask": [r["env_mask"] for r in rows],
                "env_reward": [r["reward"] for r in rows]}  # env_outcome_reward reads it


class SaveGradient(TrainerCallback):
    """Saves the gradient the optimizer receives at step `step` (1-based; after clipping)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step, self.seen = path, step, 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):  # noqa: ANN001
        self.seen += 1
        if self.seen == self.step:
            grads = {n: p.grad.detach().contiguous() for n, p in model.named_parameters()}
            safetensors.torch.save_file(grads, str(self.path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", required=True, help="JSON: {match: Match, steps: [[episode]]}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grad-step", type=int, default=1, help="step whose gradient to save")
    ap.add_argument("--out", required=True, help="directory for the outputs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = json.loads(Path(a.batches).read_text())
    steps = data["steps"]
    m = Match.from_json({**data["match"], "steps": len(steps)})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    # One dataset row per group (TRL's sampler repeats each prompt num_generations times);
    # only their number matters to the replay.
    rows = [{"prompt": [{"role": "user", "content": f"group {i}"}]}
            for i in range(m.groups * len(steps))]
    trainer = GRPOTrainer(model=model, reward_funcs=env_outcome_reward,
                          args=grpo_config(m, a.seed, str(out / "trl-out")),
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          rollout_func=Replay(steps),
                          callbacks=[SaveGradient(out / "grad.safetensors", a.grad_step)])
    trainer.train()
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    safetensors.torch.save_file(weights, str(out / "final.safetensors"))
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    (out / "steps.json").write_text(json.dumps(
        [{"loss": float(h["loss"]), "grad_norm": float(h["grad_norm"]),
          "frac_reward_zero_std": float(h.get("frac_reward_zero_std", float("nan")))}
         for h in logs]))


if __name__ == "__main__":
    main()
