"""Namespaced metrics (`rollout/`, `reward/`, `train/`, `perf/`, `eval/`) from trajectories."""

from __future__ import annotations

import statistics
from collections import defaultdict

from rollart.types import Trajectory


def _mean(xs: list[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def rollout_metrics(trajs: list[Trajectory], prefix: str = "rollout") -> dict[str, float]:
    ok = [t for t in trajs if t.error is None]
    turns = [t.num_turns for t in ok]
    model_tokens = sum(t.num_model_tokens for t in ok)
    out = {
        f"{prefix}/episodes": float(len(trajs)),
        f"{prefix}/failed": float(len(trajs) - len(ok)),
        f"{prefix}/success_rate": _mean([float(t.success) for t in ok]),
        f"{prefix}/env_return": _mean([t.env_return for t in ok]),
        f"{prefix}/episode_len": _mean([float(x) for x in turns]),
        # turns whose response gave the env no action at all (a no-op turn): the failure
        f"{prefix}/no_action_rate": (
            sum(u.action is None for t in ok for u in t.turns) / max(sum(turns), 1)
        ),
        # turns not in the strict `<answer>X</answer>` format; with `parser: lenient` a bare
        # action word still acts, so this may sit near 1.0 while the policy succeeds
        f"{prefix}/format_error_rate": (
            sum(t.format_errors for t in ok) / max(sum(turns), 1)
        ),
        f"{prefix}/model_tokens": float(model_tokens),
        f"{prefix}/total_tokens": float(sum(len(t.token_ids) for t in ok)),
        f"{prefix}/response_len": model_tokens / max(sum(turns), 1),
    }
    tasks = sorted({t.task for t in ok})
    if len(tasks) > 1:
        by_task: dict[str, list[Trajectory]] = defaultdict(list)
        for t in ok:
            by_task[t.task].append(t)
        for name, ts in by_task.items():
            out[f"{prefix}/{name}/success_rate"] = _mean([float(t.success) for t in ts])
            out[f"{prefix}/{name}/env_return"] = _mean([t.env_return for t in ts])
            out[f"{prefix}/{name}/episodes"] = float(len(ts))  # its share of the batch
    return out


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
