"""Guess episodes as both sides of `benchmarks/agentic_vs_trl.py` play, count and score them.

Imported by the benchmark (rollart's venv) and by `benchmarks/peer_trl_agentic.py` (TRL's venv,
`.venv-peer`), so nothing here imports TRL, Prefect or Dask: only the env, the episode loop
(`rollart.rollout.env_manager.run_episodes`), the chat format and the reward handler, which
need transformers, pydantic, pyarrow and gymnasium (the env registry's import).

Why one module for both: the comparison is only fair if both frameworks play the same episodes
(the env's system prompt and observations in the model's ChatML template, built in token space
by rollart's own loop, so the loss mask is exact), score them with the same reward
(`env_outcome` of the run's reward config) and count tokens and env steps the same way.

TRL's sample from a trajectory (`trl_sample`): the opening (system + first observation +
assistant header) is TRL's `prompt_ids`; everything after it (every turn's generated tokens,
the turn-closing glue, each next observation and header) is one `completion_ids` with
`env_mask` = the trajectory's loss mask over it (1 only on generated tokens). So TRL's forward
pass sees the very token sequence rollart trains on, and its loss the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rollart.config import TaskConfig
from rollart.envs.guess import GuessEnv
from rollart.models.chat import ChatFormat
from rollart.rewards.client import reward_event
from rollart.rewards.handlers import env_outcome
from rollart.rollout.env_manager import EpisodeSpec, constrained_params
from rollart.types import GenerationRequest, SamplingParams, Trajectory

EVAL_SEED_OFFSET = 1_000_000  # TaskConfig.eval_seed_offset: rollart's training seeds lie below


@dataclass(frozen=True)
class Match:
    """Every setting both frameworks share (the benchmark's CLI fills it; the results file
    records it). Defaults: `configs/smollm2-guess.yaml`'s task, sampling and learning rate."""

    steps: int = 20
    groups: int = 2  # prompts (env seeds) per step
    group_size: int = 8  # samples (episodes) per prompt
    max_new_tokens: int = 24  # per turn
    max_turns: int = 6
    low: int = 1
    high: int = 16
    format_penalty: float = -0.1
    temperature: float = 0.7
    top_p: float = 1.0
    stop: tuple[str, ...] = ("</answer>",)
    lr: float = 2e-5
    clip: float = 0.2  # PPO clip, both sides (TRL epsilon = epsilon_high)
    grad_clip: float = 1.0
    # GRPO advantage (r - mean) / (std + eps): TRL hard-codes eps 1e-4 (grpo_trainer.py,
    # `advantages / (std_rewards + 1e-4)`); rollart's algo.std_eps is set to it.
    std_eps: float = 1e-4
    max_context: int = 4096  # rollart's limit for an hf_dir model (RunConfig.max_context)
    max_batch_size: int = 16  # rows per generate call
    # Sample only the tokens of `<answer>K</answer>` turns (the task's `constrained: true`, as
    # a token bag: vLLM's `allowed_token_ids`), on both sides and in the held-out evaluation.
    constrained: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Match:
        return cls(**{**data, "stop": tuple(data["stop"])})


def guess_task(m: Match) -> TaskConfig:
    """The guess task as both sides run it (lenient parser, graded format credit; free
    sampling: SmolLM2 starts at ~19 % success, results/agentic_base_rate.json; constrained
    to answer turns: 56 %)."""
    return TaskConfig(name="guess", env_id="guess",
                      env_kwargs={"low": m.low, "high": m.high, "show_range": True},
                      max_turns=m.max_turns, format_penalty=m.format_penalty, parser="lenient",
                      format_credit="graded", constrained=m.constrained,
                      max_new_tokens=m.max_new_tokens)


def sampling(m: Match, tok: Any, greedy: bool = False) -> dict[str, SamplingParams]:
    """Per-turn sampling of the guess task (greedy: the held-out evaluation's), with the answer
    turns' token bag when `m.constrained` (what rollart's rollout service builds for the task;
    the bag, not the answer trie, as its vLLM engine samples)."""
    base = SamplingParams(max_new_tokens=m.max_new_tokens,
                          temperature=0.0 if greedy else m.temperature, top_p=m.top_p,
                          stop=list(m.stop))
    return constrained_params(base, ChatFormat(tok), [guess_task(m)], grammar=False)


def group_specs(task: TaskConfig, seeds: Sequence[int], group_size: int,
                tag: str) -> list[EpisodeSpec]:
    """`group_size` episodes per seed, grouped (consecutive), as a GRPO batch lays them out."""
    return [EpisodeSpec(task, int(s), f"{tag}/g{g}", f"{tag}/g{g}/m{k}")
            for g, s in enumerate(seeds) for k in range(group_size)]


def held_out_seeds(m: Match, offset: int = EVAL_SEED_OFFSET) -> list[int]:
    """For each secret low..high, the first seed >= `offset` that draws it.

    Greedy play against this env is a function of the secret alone (the observations depend
    on nothing else), so these episodes are the whole held-out distribution, each secret
    weighted 1/n as a uniform draw weighs it: no sampling noise. All lie at or above rollart's
    evaluation offset, so none is a training seed (`rollart.rollout.plan.group_seed` draws
    below it)."""
    env, found, seed = GuessEnv(m.low, m.high, max_turns=m.max_turns), {}, offset
    while len(found) < m.high - m.low + 1:
        env.reset(seed)
        found.setdefault(env.secret, seed)
        seed += 1
    return [found[k] for k in sorted(found)]


def episode_reward(traj: Trajectory) -> float:
    """The run's reward (`reward.function: env_outcome`): task return + mean format penalty."""
    return float(env_outcome(reward_event(traj))["reward"])


def trl_sample(traj: Trajectory) -> dict[str, list[int]]:
    """TRL's rollout_func fields of one episode: prompt_ids (the opening), completion_ids (the
    rest of the conversation), env_mask (1 on generated tokens, 0 on observations and glue)."""
    if traj.error is not None or not traj.turns:
        raise RuntimeError(f"episode {traj.sample_id} has no turn to train on: {traj.error}")
    cut = traj.turns[0].prompt_tokens  # the opening: system, first observation, header
    return {"prompt_ids": traj.token_ids[:cut], "completion_ids": traj.token_ids[cut:],
            "env_mask": [int(x) for x in traj.loss_mask[cut:]]}


@dataclass
class Tally:
    """Counts of one run, as rollart's `rollout_metrics` counts them: model tokens are the
    tokens the engine generated (loss mask 1: the token that completed the stop string and a
    sampled end-of-turn token included, chat glue excluded), env steps the turns played (one
    `env.step` each)."""

    episodes: int = 0
    env_steps: int = 0
    model_tokens: int = 0
    successes: int = 0

    def add(self, trajs: Iterable[Trajectory]) -> Tally:
        """Every episode counts as one; turns, tokens and success only of the episodes that
        ran to an end (no env error), as `rollout_metrics` counts them."""
        for t in trajs:
            self.episodes += 1
            if t.error is not None:
                continue
            self.env_steps += t.num_turns
            self.model_tokens += t.num_model_tokens
            self.successes += int(t.success)
        return self


def tally_rows(rows: Iterable[dict[str, float]]) -> Tally:
    """The same counts from rollart's metrics.jsonl rows (training iterations only): model
    tokens `rollout/model_tokens`; env steps `rollout/episode_len` (turns per finished
    episode) x finished episodes; successes `rollout/success_rate` x finished episodes."""
    out = Tally()
    for r in rows:
        if r.get("iteration", 0) < 0 or "rollout/model_tokens" not in r:
            continue  # the before-training evaluation row
        done = r["rollout/episodes"] - r.get("rollout/failed", 0.0)
        out.episodes += round(r["rollout/episodes"])
        out.env_steps += round(r["rollout/episode_len"] * done)
        out.model_tokens += round(r["rollout/model_tokens"])
        out.successes += round(r["rollout/success_rate"] * done)
    return out


class BagOnly:
    """Every token outside `allowed` gets -inf (vLLM's `allowed_token_ids`, rollart's HF
    engine's token bag): a constrained task's turns sample only its answer tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = sorted(set(allowed))

    def __call__(self, input_ids: Any, scores: Any) -> Any:  # [B, T], [B, V] -> [B, V]
        import torch

        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.allowed] = 0.0
        return scores + keep


def bag_only(requests: Sequence[GenerationRequest]) -> list[BagOnly] | None:
    """The requests' shared token bag as transformers' `generate(logits_processor=...)`
    (None when unconstrained: TRL's own generation, unchanged)."""
    bags = {tuple(r.params.allowed_token_ids or ()) for r in requests}
    if len(bags) != 1:
        raise RuntimeError("one generate call samples one task: the requests' bags differ")
    bag = bags.pop()
    return [BagOnly(list(bag))] if bag else None


def cut_completion(ids: Sequence[int], eos_ids: Iterable[int], stops: Sequence[str],
                   decode: Callable[[list[int]], str], max_new_tokens: int,
                   ) -> tuple[list[int], str]:
    """(kept tokens, finish reason) of one generated row by rollart's HF engine rule: up to
    and including the first end-of-turn token ("eos"), or the token whose arrival puts a stop
    string into the tail of the decoded text ("stop"), else `max_new_tokens` ("length").

    Used on TRL's side: transformers' batched `generate` pads a row that stopped (on
    `stop_strings`) with the pad token, which for SmolLM2 is the end-of-turn token itself;
    TRL's own cut ("everything after the first EOS", `_generate_single_turn`) would keep
    that pad as if the model had sampled it."""
    eos, kept = set(eos_ids), []
    window = max((len(s) for s in stops), default=0) + 2  # as HFEngine._stop_hit
    for tok in list(ids)[:max_new_tokens]:
        kept.append(int(tok))
        if tok in eos:
            return kept, "eos"
        if stops and any(s in decode(kept[-window:]) for s in stops):
            return kept, "stop"
    return kept, "length"

