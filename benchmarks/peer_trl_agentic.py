"""TRL 1.16's GRPOTrainer on multi-turn guess episodes (the peer side of agentic_vs_trl.py).

Runs in the peer venv (`make peer` -> .venv-peer: trl==1.16.0, transformers<5.20, gymnasium for
rollart's env registry), never in rollart's venv. `--data` (written by the benchmark) holds the
shared settings (`agentic_episodes.Match`) and the env seeds of every step's groups, the very
seeds rollart's run plays (`rollart.rollout.plan.plan_iteration`).

Which multi-turn mechanism, and why (trl 1.16.0, trl/trainer/grpo_trainer.py, lines 650, 1889,
1957, 2210, 2272, 2497; `mechanism()` finds the quoted lines in the installed file and the
results file records them):

- `GRPOTrainer(environment_factory=...)`: the env's public methods become *tools*; the episode
  continues only while the model's reply parses as a tool call (`_tool_call_loop`: `while
  idxs_with_tool and ...`), and observations come back as `tool` messages. The guess game's
  action is a tagged answer `<answer>K</answer>`, not a tool call, and SmolLM2-135M-Instruct's
  chat template renders no tool calls at all: the constructor refuses it (`if not
  supports_tool_calling(processing_class): raise ValueError(...)`; `--probe` constructs one
  and records the error).
- `rollout_func` (experimental): TRL calls `self.rollout_func(prompts, self)` in place of its
  own generation and takes `prompt_ids`, `completion_ids`, `logprobs`, plus an optional
  `env_mask` (`tool_mask = extra_fields.pop("env_mask", None)`), which enters the loss mask
  (`loss_mask = completion_mask * tool_mask`); other returned fields reach the reward
  functions as keyword arguments. So a rollout_func can play whole episodes with the game's
  own action format, and observation tokens are kept out of TRL's loss as out of rollart's.
  This is the mechanism used here.

The rollout_func plays each step's episodes with rollart's episode loop
(`rollart.rollout.env_manager.run_episodes`: ChatML turns in token space, all live episodes in
lockstep, one batched generate per turn) and generates every turn with TRL's own generation
path (`_generate_single_turn`'s transformers branch: left-padded `model.generate` under
`unwrap_model_for_generation` with the trainer's `generation_config`), adding only the stop
string (`stop_strings`, which needs the tokenizer passed to `generate`) and rollart's per-row
finish rule (`agentic_episodes.cut_completion`). Behaviour log-probs are not computed: TRL uses
them only with vLLM (its importance-sampling correction); without vLLM its own path returns
None too. Rewards: rollart's `env_outcome` of each trajectory, returned as `env_reward`.

Timing (measured only): a callback stamps each optimizer step; `_generate_and_score_completions`
is wrapped to time rollout + scoring (the rest of a step is training); the rollout_func times
itself. Writes `--out` (JSON) and saves the final model to `--save`.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rollart's pure modules

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402
from trl.trainer.utils import pad  # noqa: E402

from benchmarks.agentic_episodes import (  # noqa: E402
    Match,
    Tally,
    bag_only,
    cut_completion,
    episode_reward,
    guess_task,
    sampling,
    trl_sample,
)
from rollart.envs.guess import GuessEnv  # noqa: E402
from rollart.models.chat import ChatFormat  # noqa: E402
from rollart.rollout.env_manager import EpisodeSpec, run_episodes  # noqa: E402
from rollart.types import Completion, GenerationRequest  # noqa: E402

EVIDENCE = {  # what in TRL's source decides the mechanism (see the module docstring)
    "rollout_func_call": "output = self.rollout_func(prompts, self)",
    "env_mask_pop": 'tool_mask = extra_fields.pop("env_mask", None)',
    "loss_mask": "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_",
    "tool_loop_condition": "while idxs_with_tool and iteration_num < self.max_tool_calling_",
    "tool_template_check": "if not supports_tool_calling(processing_class):",
    "no_logprobs_without_vllm": "logprobs = None  # not used in this case",
    "advantage_eps": "advantages = advantages / (std_rewards + 1e-4)",
}
WHY = ("environment_factory turns the env's public methods into tools and continues an "
       "episode only while the reply parses as a tool call (the tool-call loop's condition); "
       "the guess game's actions are tagged answers, and SmolLM2's chat template renders no "
       "tool calls, so GRPOTrainer refuses it (the tool-template check; `environment_factory` "
       "in this file records the error). rollout_func replaces TRL's generation with the "
       "caller's and takes an env_mask that enters TRL's loss mask, so it plays the same "
       "multi-turn episodes in the same action format with observation tokens out of the loss: "
       "TRL can learn the task through it.")
CONFIG_KEYS = ("per_device_train_batch_size", "num_generations", "gradient_accumulation_steps",
               "steps_per_generation", "num_iterations", "max_completion_length", "temperature",
               "top_p", "top_k", "learning_rate", "lr_scheduler_type", "weight_decay", "optim",
               "max_grad_norm", "max_steps", "loss_type", "scale_rewards", "beta", "epsilon",
               "epsilon_high", "importance_sampling_level", "entropy_coef",
               "mask_truncated_completions", "gradient_checkpointing", "use_vllm", "seed")


def mechanism() -> dict[str, Any]:
    """Where each EVIDENCE line sits in the installed grpo_trainer.py (line numbers), so the
    results file says which source the choice was read from."""
    import transformers
    import trl

    path = Path(inspect.getsourcefile(GRPOTrainer) or "")
    lines = path.read_text().splitlines()
    found = {}
    for key, text in EVIDENCE.items():
        hits = [i + 1 for i, line in enumerate(lines) if text in line]
        found[key] = {"text": text, "lines": hits}
    return {"chosen": "rollout_func", "why": WHY, "trl": trl.__version__,
            "transformers": transformers.__version__,
            "file": str(path.relative_to(path.parents[2])), "evidence": found}


class GuessGame:
    """The guess game as TRL's `environment_factory` wants it: `reset` and one tool method."""

    def __init__(self) -> None:
        self.env = GuessEnv()

    def reset(self, **kwargs: Any) -> str:
        return self.env.reset(int(kwargs.get("seed", 0)))[0]

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guess.

        Returns:
            Whether the secret is higher or lower.
        """
        return self.env.step(f"<answer>{number}</answer>")[0]


def probe_environment_factory(model_dir: str) -> dict[str, Any]:
    """Construct GRPOTrainer(environment_factory=GuessGame) with this model: what TRL says."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Guess."}]}] * 2)
    args = GRPOConfig(output_dir="/tmp/trl-probe", per_device_train_batch_size=2,
                      num_generations=2, max_steps=1, use_cpu=True, report_to=[])
    try:
        GRPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                    environment_factory=GuessGame)
    except Exception as err:  # the answer we record
        return {"accepted": False, "error": f"{type(err).__name__}: {err}"}
    return {"accepted": True, "error": None}


class TRLGenerate:
    """rollart's GenerateFn over TRL's generation path (see the module docstring)."""

    def __init__(self, trainer: GRPOTrainer, tok: Any, m: Match) -> None:
        self.trainer, self.tok, self.m = trainer, tok, m
        self.eos_ids = list(trainer.eos_token_ids)
        # TRL's generation config plus the stop string (`generate` then needs the tokenizer)
        self.config = copy.deepcopy(trainer.generation_config)
        self.config.stop_strings = list(m.stop)
        self.generate_s = 0.0

    def __call__(self, requests: list[GenerationRequest]) -> list[Completion]:
        out: list[Completion] = []
        for i in range(0, len(requests), self.m.max_batch_size):
            out += self._batch(requests[i:i + self.m.max_batch_size])
        return out

    def _batch(self, requests: list[GenerationRequest]) -> list[Completion]:
        t0 = time.perf_counter()
        tr, tok = self.trainer, self.tok
        prompts = [torch.tensor(r.prompt_ids) for r in requests]
        ids = pad(prompts, padding_value=tok.pad_token_id, padding_side="left")
        mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left")
        bag = bag_only(requests)  # a constrained task: its answer tokens only, as rollart's
        with (unwrap_model_for_generation(tr.model_wrapped, tr.accelerator,
                                          generation_kwargs=tr.generation_kwargs) as model,
              torch.no_grad()):
            full = model.generate(input_ids=ids, attention_mask=mask,
                                  generation_config=self.config, tokenizer=tok,
                                  logits_processor=LogitsProcessorList(bag) if bag else None)
        dt = time.perf_counter() - t0
        self.generate_s += dt
        version = int(tr.state.global_step)
        out = []
        for r, row in zip(requests, full[:, ids.shape[1]:].tolist(), strict=True):
            kept, why = cut_completion(row, self.eos_ids, self.m.stop,
                                       lambda t: tok.decode(t, skip_special_tokens=False),
                                       self.m.max_new_tokens)
            out.append(Completion(r.request_id, kept, [0.0] * len(kept),
                                  tok.decode(kept, skip_special_tokens=False), why, version,
                                  len(r.prompt_ids), dt))
        return out


class Rollouts:
    """The rollout_func: each prompt (its user message carries the env seed) is one episode."""

    def __init__(self, m: Match, tok: Any) -> None:
        self.m, self.tok, self.task = m, tok, guess_task(m)
        self.chat = ChatFormat(tok)
        self.generate: TRLGenerate | None = None  # set once the trainer exists
        self.steps: list[dict[str, Any]] = []
        self.tally = Tally()

    def __call__(self, prompts: list[list[dict[str, Any]]], trainer: GRPOTrainer) -> dict:
        if self.generate is None:
            self.generate = TRLGenerate(trainer, self.tok, self.m)
        t0, gen0 = time.perf_counter(), self.generate.generate_s
        step = len(self.steps)
        g = self.m.group_size  # TRL repeats each prompt g times (RepeatSampler): one group
        seeds = [int(p[-1]["env_seed"]) for p in prompts]
        if len(seeds) != self.m.groups * g or any(len(set(seeds[i:i + g])) != 1
                                                   for i in range(0, len(seeds), g)):
            raise RuntimeError(f"expected {self.m.groups} groups of {g} repeated prompts, "
                               f"got seeds {seeds}")
        specs = [EpisodeSpec(self.task, s, f"s{step}/g{i // g}", f"s{step}/e{i}", step)
                 for i, s in enumerate(seeds)]
        trajs = run_episodes(specs, self.generate, self.chat, sampling(self.m, self.tok),
                             self.m.max_context)
        samples = [trl_sample(t) for t in trajs]
        counts = Tally().add(trajs)
        self.tally.add(trajs)
        rewards = [episode_reward(t) for t in trajs]
        self.steps.append({"seeds": [s.seed for s in specs], "episodes": counts.episodes,
                           "env_steps": counts.env_steps, "model_tokens": counts.model_tokens,
                           "success_rate": counts.successes / max(counts.episodes, 1),
                           "reward_mean": sum(rewards) / len(rewards),
                           "rollout_s": time.perf_counter() - t0,
                           "example": self.tok.decode(trajs[0].token_ids),
                           "generate_s": self.generate.generate_s - gen0})
        return {"prompt_ids": [s["prompt_ids"] for s in samples],
                "completion_ids": [s["completion_ids"] for s in samples],
                "logprobs": None, "env_mask": [s["env_mask"] for s in samples],
                "env_reward": rewards}


def env_outcome_reward(completions: list[Any], env_reward: list[float], **_: Any) -> list[float]:
    """The reward the rollout_func computed per episode (rollart's `env_outcome`)."""
    return [float(r) for r in env_reward]


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.t0 = 0.0
        self.steps: list[float] = []

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        self.steps.append(time.perf_counter() - self.t0)


def grpo_config(m: Match, seed: int, out_dir: str) -> GRPOConfig:
    """Every loss and optimizer setting explicit, set to what rollart's run uses."""
    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=m.groups * m.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=m.group_size, max_completion_length=m.max_new_tokens,  # per turn
        temperature=m.temperature, top_p=m.top_p, top_k=0, min_p=None, repetition_penalty=1.0,
        learning_rate=m.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=m.grad_clip, max_steps=m.steps,
        # rollart: algo.loss ppo_clip, loss_agg seq_mean_token_mean (token mean per episode,
        # then mean over episodes) = TRL "grpo"; advantage grpo (group std) = scale_rewards
        # "group"; kl_coef 0 = beta 0 (no reference model); clip 0.2/0.2; entropy_coef 0.
        loss_type="grpo", scale_rewards="group", beta=0.0, epsilon=m.clip,
        epsilon_high=m.clip, importance_sampling_level="token", entropy_coef=0.0,
        top_entropy_quantile=1.0, mask_truncated_completions=False,
        gradient_checkpointing=False,  # rollart keeps activations (TRL 1.16 defaults to True)
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, fp16=False,
        seed=seed, shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
    )


def opening(task_system: str, observation: str, seed: int) -> list[dict[str, Any]]:
    """A dataset prompt: the env's opening messages; the seed rides on them because a
    rollout_func receives only the prompts (`self.rollout_func(prompts, self)`)."""
    return [{"role": "system", "content": task_system, "env_seed": seed},
            {"role": "user", "content": observation, "env_seed": seed}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", help="JSON: {match: Match, train_seeds: [[seed per group]]}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", help="final model directory")
    ap.add_argument("--probe", action="store_true",
                    help="only record the mechanism evidence and what environment_factory does")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.probe:
        out = {"mechanism": mechanism(), "environment_factory": probe_environment_factory(a.model)}
        Path(a.out).write_text(json.dumps(out, indent=1))
        return
    data = json.loads(Path(a.data).read_text())
    m = Match.from_json(data["match"])
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    env = GuessEnv(m.low, m.high, max_turns=m.max_turns)
    rows = [{"prompt": opening(env.system_prompt, env.reset(s)[0], s)}
            for step in data["train_seeds"][: m.steps] for s in step]
    rollouts, clock = Rollouts(m, tok), StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=env_outcome_reward,
                          args=grpo_config(m, a.seed, str(Path(a.save) / "trl-out")),
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          rollout_func=rollouts, callbacks=[clock])
    score_s: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*args_: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = inner(*args_, **kw)
        score_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed
    load_s = time.perf_counter() - t_load
    trainer.train()
    train_end = time.perf_counter()
    trainer.save_model(a.save)
    tok.save_pretrained(a.save)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    t = rollouts.tally
    Path(a.out).write_text(json.dumps({
        "framework": "trl", "mechanism": mechanism(), "import_s": t_load - T_START,
        "load_s": load_s, "train_s": train_end - t_load - load_s,
        "save_s": time.perf_counter() - train_end, "step_s": clock.steps,
        "rollout_and_score_s": score_s, "steps": rollouts.steps,
        "episodes": t.episodes, "env_steps": t.env_steps, "model_tokens": t.model_tokens,
        "successes": t.successes, "reward": [h["reward"] for h in logs],
        "trl_completion_mean_length": [h.get("completions/mean_length") for h in logs],
        "frac_reward_zero_std": [h.get("frac_reward_zero_std") for h in logs],
        "grad_norm": [h.get("grad_norm") for h in logs],
        "trl_config": {k: str(getattr(trainer.args, k)) for k in CONFIG_KEYS},
    }, indent=1))


if __name__ == "__main__":
    main()
