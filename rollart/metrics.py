"""Namespaced metrics (`rollout/`, `reward/`, `train/`, `perf/`, `eval/`) from trajectories."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from rollart.types import Trajectory


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


class TrajStats(NamedTuple):
    """What `rollout_metrics` reads of one trajectory: computed once per episode where it ends
    (the rollout service, on its loop), so taking a batch of thousands of episodes does not walk
    every token of every trajectory on the trainer's side (milliseconds under the GIL that held
    every turn in flight up)."""

    ok: bool
    success: bool
    env_return: float
    turns: int
    no_action_turns: int
    format_errors: int
    model_tokens: int
    total_tokens: int
    task: str
    start_version: int  # the policy version of its first turn (-1: no turn)
    # new (non-model) tokens prefilled before each turn, summed: the prefill side of the task's
    # profile (system prompt and first observation, then each observation)
    prompt_tokens: int = 0


def traj_stats(t: Trajectory) -> TrajStats:
    return TrajStats(t.error is None, t.success, t.env_return, t.num_turns,
                     sum(u.action is None for u in t.turns), t.format_errors,
                     t.num_model_tokens, len(t.token_ids), t.task,
                     t.turns[0].weight_version if t.turns else -1,
                     sum(u.prompt_tokens for u in t.turns))


def _summary(prefix: str, every: int, ok: list[TrajStats]) -> dict[str, float]:
    """The figures of `ok` (the episodes that ran to an end) out of `every` episodes."""
    # one column per field (zip and sum run in C: a batch of thousands of episodes is taken
    # on the rollout service's side, under the GIL that every turn in flight needs)
    col = TrajStats(*zip(*ok, strict=True)) if ok else TrajStats(*([()] * len(TrajStats._fields)))
    n = len(ok)
    turns = sum(col.turns)
    model_tokens = sum(col.model_tokens)
    return {
        f"{prefix}/episodes": float(every),
        f"{prefix}/failed": float(every - n),
        f"{prefix}/success_rate": sum(col.success) / n if n else 0.0,
        f"{prefix}/env_return": _mean(col.env_return),
        f"{prefix}/episode_len": turns / n if n else 0.0,  # mean turns per episode
        # turns whose response gave the env no action at all (a no-op turn): the failure
        f"{prefix}/no_action_rate": sum(col.no_action_turns) / max(turns, 1),
        # turns not in the strict `<answer>X</answer>` format; with `parser: lenient` a bare
        # action word still acts, so this may sit near 1.0 while the policy succeeds
        f"{prefix}/format_error_rate": sum(col.format_errors) / max(turns, 1),
        f"{prefix}/model_tokens": float(model_tokens),
        f"{prefix}/total_tokens": float(sum(col.total_tokens)),
        f"{prefix}/response_len": model_tokens / max(turns, 1),  # decode tokens per turn
        f"{prefix}/prompt_len": sum(col.prompt_tokens) / max(turns, 1),  # prefill per turn
    }


def rollout_metrics(trajs: list[Trajectory], prefix: str = "rollout",
                    stats: list[TrajStats] | None = None) -> dict[str, float]:
    """The batch's figures under `{prefix}/...`; with several tasks in it, the same figures per
    task under `{prefix}/task/{name}/...` (a mixed batch's mean hides which task learns and
    what each costs per turn: the prefill/decode profile the router places by). `stats`:
    `traj_stats` of each of `trajs` where the caller has them already."""
    every = stats if stats is not None else [traj_stats(t) for t in trajs]
    out = _summary(prefix, len(every), [s for s in every if s.ok])
    if len({s.task for s in every}) > 1:  # failed episodes count: a task that only failed
        by_task: dict[str, list[TrajStats]] = defaultdict(list)
        for s in every:
            by_task[s.task].append(s)
        for name in sorted(by_task):
            ss = by_task[name]
            out.update(_summary(f"{prefix}/task/{name}", len(ss), [s for s in ss if s.ok]))
    return out


def task_metrics(metrics: dict[str, float], prefix: str = "rollout") -> dict[str, dict[str, float]]:
    """{task: {figure: value}} of one metrics row's `{prefix}/task/{name}/{figure}` keys (task
    names may hold '/'; figures never do)."""
    head = f"{prefix}/task/"
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in metrics.items():
        if key.startswith(head) and "/" in key[len(head):]:
            name, _, figure = key[len(head):].rpartition("/")
            out[name][figure] = value
    return dict(out)


def reward_metrics(trajs: list[Trajectory], zero_var_groups: int) -> dict[str, float]:
    rewards = [t.reward for t in trajs if t.reward is not None]
    return {
        "reward/mean": _mean(rewards),
        "reward/std": float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0,
        "reward/max": max(rewards, default=0.0),
        "reward/min": min(rewards, default=0.0),
        "reward/zero_variance_groups": float(zero_var_groups),
        "reward/score_s": sum(t.timings.get("reward_s", 0.0) for t in trajs),
    }


# Columns of the per-iteration table (terminal progress and the Prefect table artifact).
SUMMARY_KEYS = [
    ("iter", "iteration"),
    ("reward", "reward/mean"),
    ("success", "rollout/success_rate"),
    ("ep_len", "rollout/episode_len"),
    ("no_act", "rollout/no_action_rate"),
    ("tokens", "rollout/model_tokens"),
    ("entropy", "train/entropy"),
    ("eval", "eval/success_rate"),
    ("iter_s", "perf/iteration_s"),
]


def summary_row(m: dict[str, float]) -> dict[str, float | str]:
    row: dict[str, float | str] = {}
    for name, key in SUMMARY_KEYS:
        v = m.get(key)
        row[name] = "" if v is None else (int(v) if name in ("iter", "tokens") else round(v, 3))
    return row
