"""Env manager: runs multi-turn episodes against an inference engine and builds trajectories.

The conversation is built incrementally in token space so the loss mask is exact: system and user
turns and the chat-template glue are masked (0); every token the engine generated is unmasked (1)
and carries its behaviour log-prob and the weight version that produced it.

This loop advances all live episodes of a batch in lockstep (one batched `generate` call per turn),
which keeps the engine busy with large batches. Env failures cost the episode, never the batch.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rollart.action_grammar import dump_grammar, token_grammar, token_texts
from rollart.config import TaskConfig
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.types import Completion, GenerationRequest, SamplingParams, Trajectory, Turn

GenerateFn = Callable[[list[GenerationRequest]], list[Completion]]


@dataclass(frozen=True)
class EpisodeSpec:
    task: TaskConfig
    seed: int
    group_id: str
    sample_id: str
    iteration: int = 0


@dataclass
class _Episode:
    spec: EpisodeSpec
    traj: Trajectory
    env: object
    observation: str = ""
    done: bool = False
    pending_prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "env_s": 0.0})
    # (tokens, mask, log-probs or None, version) of each `extend`: the trajectory's loss mask,
    # behaviour log-probs and versions are built from them once, by `finish_episode`. Growing
    # four lists a turn cost the rollout service's loop ~10 % of its time at 4,096 episodes
    # (benchmarks/rollout_scale.py): each is cold by the episode's next turn, and reallocs.
    segments: list[tuple[int, int, list[float] | None, int]] = field(default_factory=list)

    def extend(self, ids: list[int], mask: int, logprobs: list[float] | None = None,
               version: int = -1) -> None:
        self.traj.token_ids.extend(ids)  # every turn's request needs the whole context
        self.segments.append((len(ids), mask, logprobs, version))


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


def constrain(traj: Trajectory, params: SamplingParams) -> None:
    """Record on `traj` the restriction its turns are sampled under (the trainer re-applies it
    per position, so recomputed log-probs are the engine's)."""
    traj.allowed_token_ids = params.allowed_token_ids
    traj.allowed_sequences = params.allowed_sequences
    traj.grammar = params.grammar


def _new_trajectory(spec: EpisodeSpec) -> Trajectory:
    return Trajectory(
        sample_id=spec.sample_id, task=spec.task.name, env_id=spec.task.env_id,
        group_id=spec.group_id, seed=spec.seed, iteration=spec.iteration,
        token_ids=[], loss_mask=[], behaviour_logprobs=[], token_versions=[],
    )


def _fail(ep: _Episode, where: str) -> None:
    ep.traj.error = f"{where}: {traceback.format_exc(limit=2).strip().splitlines()[-1]}"
    ep.done = True


def finish_episode(ep: _Episode) -> Trajectory:
    """The episode's trajectory with its per-token lists filled (the loss mask, behaviour
    log-probs and versions of every token so far); call it before the trajectory leaves."""
    t = ep.traj
    mask, logprobs, versions = t.loss_mask, t.behaviour_logprobs, t.token_versions
    pos, added = len(mask), 0
    for seg in ep.segments:
        added += seg[0]
    # Grown once to their length, as for a prompt or glue segment (mask 0, no log-prob,
    # version -1); only the generated segments are written over. Most segments are prompt or
    # glue: appending every segment to the three lists cost ~1.4x this.
    mask += [0] * added
    logprobs += [0.0] * added
    versions += [-1] * added
    for n, m, lp, version in ep.segments:
        end = pos + n
        if m:
            mask[pos:end] = [m] * n
            versions[pos:end] = [version] * n
        if lp is not None:
            logprobs[pos:end] = lp  # n log-probs: one per generated token
        pos = end
    ep.segments = []
    return t


def new_episode(spec: EpisodeSpec) -> _Episode:
    """An episode with an empty trajectory and no env yet."""
    return _Episode(spec=spec, traj=_new_trajectory(spec), env=None)


def fail_episode(ep: _Episode, where: str) -> None:
    """End `ep` with the exception being handled as its error (call inside `except`)."""
    _fail(ep, where)


def begin_episode(ep: _Episode, chat: ChatFormat, system: str, observation: str,
                  prompt_ids: list[int] | None = None) -> None:
    """The env was reset: the system prompt, first observation and assistant header (their
    ids as given, when an env host tokenized them, else tokenized here)."""
    ep.observation = observation
    if prompt_ids is None:
        prompt_ids = chat.first_prompt(system, observation)
    ep.extend(prompt_ids, 0)
    ep.pending_prompt_tokens = len(ep.traj.token_ids)


def start_episode(spec: EpisodeSpec, chat: ChatFormat,
           env_factory: Callable[[TaskConfig], object] = make_env) -> _Episode:
    ep = new_episode(spec)
    t0 = time.perf_counter()
    try:
        ep.env = env_factory(spec.task)
        observation, info = ep.env.reset(seed=spec.seed)
        system = ep.env.system_prompt
    except Exception:
        _fail(ep, "reset")
        return ep
    finally:
        ep.timings["env_s"] += time.perf_counter() - t0
    # the ids of an env host that tokenizes (rollart/rollout/env_host.py), else made here
    begin_episode(ep, chat, system, observation, (info or {}).get("prompt_ids"))
    return ep


def record_completion(ep: _Episode, comp: Completion, chat: ChatFormat) -> None:
    """Append the generated tokens (mask 1, their log-probs and version) and the turn's end."""
    ep.extend(comp.token_ids, 1, comp.logprobs, comp.weight_version)
    ep.extend(chat.end_after_eos() if comp.finish_reason == "eos" else chat.assistant_end(), 0)


StepResult = tuple[str, float, bool, bool, dict]


def record_step(ep: _Episode, comp: Completion, result: StepResult, env_s: float,
                chat: ChatFormat, max_context: int, max_new_tokens: int) -> None:
    """The env answered the completion with `result`: record the turn, append the next
    observation (or end the episode: terminated, truncated, or context budget exhausted)."""
    obs, reward, terminated, truncated, info = result
    traj = ep.traj
    traj.turns.append(Turn(
        index=len(traj.turns), observation=ep.observation, response=comp.text,
        action=info.get("action"), format_ok=bool(info.get("format_ok", False)),
        env_reward=float(reward), prompt_tokens=ep.pending_prompt_tokens,
        completion_tokens=len(comp.token_ids), weight_version=comp.weight_version,
        generate_s=comp.generate_s, env_s=env_s,
    ))
    traj.env_return += float(reward)
    traj.task_return += float(info.get("task_reward", reward))
    traj.format_penalty += float(info.get("format_penalty", 0.0))
    traj.format_errors += 0 if info.get("format_ok", False) else 1
    traj.success = traj.success or bool(info.get("success", False))
    traj.terminated, traj.truncated = bool(terminated), bool(truncated)
    if terminated or truncated:
        ep.done = True
        return
    # An env host that tokenizes its observations (with the run's chat format) sends the ids
    # of `chat.next_prompt(obs)` as info["prompt_ids"]: one tokenization less here.
    next_ids = info.get("prompt_ids") or chat.next_prompt(obs)
    if len(traj.token_ids) + len(next_ids) + max_new_tokens > max_context:
        traj.truncated, ep.done = True, True  # context budget exhausted
        return
    ep.observation = obs
    ep.extend(next_ids, 0)
    ep.pending_prompt_tokens = len(next_ids)


def apply_completion(ep: _Episode, comp: Completion, chat: ChatFormat, max_context: int,
           max_new_tokens: int) -> None:
    """Append the completion, step the env, append the next observation."""
    record_completion(ep, comp, chat)
    t0 = time.perf_counter()
    try:
        result = ep.env.step(comp.text)
    except Exception:
        ep.timings["env_s"] += time.perf_counter() - t0
        _fail(ep, "step")
        return
    env_s = time.perf_counter() - t0
    ep.timings["env_s"] += env_s
    record_step(ep, comp, result, env_s, chat, max_context, max_new_tokens)


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
    episodes = [start_episode(s, chat) for s in specs]
    for ep in episodes:
        constrain(ep.traj, by_task[ep.spec.task.name])
        if ep.done and on_done is not None:  # reset failed
            on_done(finish_episode(ep))
    while True:
        live = [ep for ep in episodes if not ep.done]
        if not live:
            break
        requests = [
            GenerationRequest(f"{ep.spec.sample_id}#t{ep.traj.num_turns}",
                              list(ep.traj.token_ids), by_task[ep.spec.task.name])
            for ep in live
        ]
        t0 = time.perf_counter()
        completions = generate(requests)
        gen_s = time.perf_counter() - t0
        by_id = {c.request_id: c for c in completions}
        for ep, req in zip(live, requests, strict=True):
            ep.timings["generate_s"] += gen_s
            apply_completion(ep, by_id[req.request_id], chat, max_context,
                             req.params.max_new_tokens)
            if ep.done and on_done is not None:
                ep.traj.timings.update(ep.timings)
                on_done(finish_episode(ep))
    out = []
    for ep in episodes:
        if ep.env is not None:
            try:
                ep.env.close()
            except Exception:  # closing a broken env must not cost the episode
                pass
        ep.traj.timings.update(ep.timings)
        out.append(finish_episode(ep))
    return out
