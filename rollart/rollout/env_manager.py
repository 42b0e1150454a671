"""Env manager: runs multi-turn episodes against an inference engine (evaluation, and the
per-task sampling params of every episode).

`run_episodes` advances all live episodes of a batch in lockstep (one batched `generate` call per
turn), which keeps the engine busy with large batches. Each episode's turns, token bookkeeping
and failure policy are `EpisodeSteps` (rollart/rollout/episode_step.py), the routine the rollout
service's runners drive too. Env failures cost the episode, never the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rollart.action_grammar import dump_grammar, token_grammar, token_texts
from rollart.config import TaskConfig
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.rollout.episode_step import (
    Action,
    EpisodeSpec,
    EpisodeSteps,
    Generate,
    Step,
    open_env,
    take,
)
from rollart.types import Completion, GenerationRequest, SamplingParams, Trajectory

__all__ = ["EpisodeSpec", "GenerateFn", "answer_sequences", "answer_token_ids",
           "constrained_params", "run_episodes"]

GenerateFn = Callable[[list[GenerationRequest]], list[Completion]]


def answer_token_ids(chat: ChatFormat, action_names: list[str]) -> list[int]:
    """Every token of `<answer>{action}</answer>` for each action, plus end of turn."""
    ids = {chat.eos_id}
    for name in action_names:
        ids.update(chat.encode(f"<answer>{name}</answer>"))
    return sorted(ids)


def answer_sequences(chat: ChatFormat, action_names: list[str]) -> list[list[int]]:
    """The token ids of each whole answer turn, `<answer>{action}</answer>` and end of turn
    (the answer grammar, rollart.answer_trie)."""
    return [[*chat.encode(f"<answer>{name}</answer>"), chat.eos_id] for name in action_names]


def constrained_params(params: SamplingParams, chat: ChatFormat, tasks: list[TaskConfig],
                       grammar: bool = False) -> dict[str, SamplingParams]:
    """Per-task sampling params: the task's `max_new_tokens` if set; constrained tasks get
    `allowed_token_ids` (built from the env, so this runs where env code may run: an env-class
    worker) and, with `grammar` (engines that walk a grammar per token: HF), the walk itself.

    An env with `action_names` gives the answer trie of `<answer>{action}</answer>` turns
    (`allowed_sequences`); one without them but with an `action_grammar` (free tool calls) gives
    the token grammar (`grammar`, rollart.action_grammar) and its bag (the grammar's tokens and
    end of turn). A constrained task whose env has neither is refused: its bag would be end of
    turn alone."""
    out = {}
    for task in tasks:
        allowed, seqs, text = None, None, None
        if task.constrained:
            env = make_env(task)
            names = list(env.action_names)
            spec = None if names else getattr(env, "action_grammar", None)
            env.close()
            if names:
                allowed = answer_token_ids(chat, names)
                seqs = answer_sequences(chat, names) if grammar else None
            elif spec is not None:
                texts = token_texts(chat.tokenizer)
                text = dump_grammar(spec, chat.eos_id, texts)
                allowed = list(token_grammar(text, texts).bag)
                text = text if grammar else None
            else:
                raise ValueError(f"task {task.name!r}: constrained: true needs an env with "
                                 "action_names or an action_grammar; set constrained: false")
        out[task.name] = replace(params, allowed_token_ids=allowed, allowed_sequences=seqs,
                                 grammar=text,
                                 max_new_tokens=task.max_new_tokens or params.max_new_tokens)
    return out


@dataclass
class _Evaluated:
    """One episode of `run_episodes`: its steps, its env (once made), its action under way."""

    spec: EpisodeSpec
    steps: EpisodeSteps
    env: Any = None
    action: Action | None = None

    def perform(self, action: Action) -> Any:
        """An env action, in this process (generation is batched by `run_episodes`)."""
        if type(action) is Step:
            return self.env.step(action.text)
        self.env = make_env(self.spec.task)
        return open_env(self.env, self.spec.seed)


def run_episodes(
    specs: list[EpisodeSpec],
    generate: GenerateFn,
    chat: ChatFormat,
    params: SamplingParams | dict[str, SamplingParams],
    max_context: int = 1024,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Run every episode to completion; returns trajectories in the order of `specs`.

    `params` is one SamplingParams for all, or one per task name. `on_done(trajectory)` is
    called as soon as each episode ends (e.g. to invoke its reward while others still run)."""
    by_task = params if isinstance(params, dict) else {s.task.name: params for s in specs}
    # An error in an episode's own bookkeeping raises here (contain_errors=False), as an error
    # of the batched `generate` call does: evaluation has no one to count failed episodes.
    episodes = [_Evaluated(s, EpisodeSteps(s, chat, by_task[s.task.name], max_context,
                                           contain_errors=False)) for s in specs]
    for ep in episodes:  # every env is made and reset before the first turn
        ep.action = take(ep.steps, ep.steps.start(), ep.perform)
    for ep in episodes:
        if ep.action is None and on_done is not None:  # reset failed
            on_done(ep.steps.finish())
    while True:
        live = [ep for ep in episodes if ep.action is not None]
        if not live:
            break
        requests: list[GenerationRequest] = []
        for ep in live:
            assert type(ep.action) is Generate  # env actions are taken as they are handed out
            requests.append(ep.action.request)
        t0 = time.perf_counter()
        completions = generate(requests)
        gen_s = time.perf_counter() - t0  # every episode of the call waited for all of it
        by_id = {c.request_id: c for c in completions}
        for ep, req in zip(live, requests, strict=True):
            step = ep.steps.advance(by_id[req.request_id], seconds=gen_s)
            ep.action = None if step is None else take(ep.steps, step, ep.perform)
            if ep.action is None and on_done is not None:
                ep.steps.traj.timings.update(ep.steps.timings)
                on_done(ep.steps.finish())
    out = []
    for ep in episodes:
        if ep.env is not None:
            try:
                ep.env.close()
            except Exception:  # closing a broken env must not cost the episode
                pass
        ep.steps.traj.timings.update(ep.steps.timings)
        out.append(ep.steps.finish())
    return out
