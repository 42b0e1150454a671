"""Pure planning of which episodes an iteration runs: groups per task, seeds, sample ids."""

from __future__ import annotations

import random
from collections.abc import Callable

from rollart.config import RunConfig, TaskConfig
from rollart.rollout.env_manager import EpisodeSpec
from rollart.rollout.ids import eval_id, group_id, parse_group_id, sample_id
from rollart.rollout.scheduler import split_by_share


def group_seed(cfg: RunConfig, task: TaskConfig, iteration: int, group: int) -> int:
    if task.seeds == "fixed":
        return cfg.seed
    # Deterministic per (run seed, task, iteration, group); below the eval offset by construction.
    rng = random.Random(f"{cfg.seed}/{task.name}/{iteration}/{group}")
    return rng.randrange(task.eval_seed_offset)


def plan_iteration(cfg: RunConfig, iteration: int) -> list[EpisodeSpec]:
    """`num_groups` groups of `group_size` episodes; members of a group share a seed."""
    specs: list[EpisodeSpec] = []
    counts = split_by_share(cfg.rollout.num_groups, [t.share for t in cfg.tasks])
    for task, n_groups in zip(cfg.tasks, counts, strict=True):
        for g in range(n_groups):
            seed = group_seed(cfg, task, iteration, g)
            gid = group_id(task.name, iteration, g)
            for m in range(cfg.rollout.group_size):
                specs.append(EpisodeSpec(task, seed, gid, sample_id(gid, m), iteration))
    return specs


def eval_counts(episodes: int, shares: list[float]) -> list[int]:
    """Evaluation episodes per task: split by share, but every task gets at least one while
    there are enough (a task with a small share would otherwise get none, and the evaluation
    would report no success rate for it); each one it lacks comes from the task with most."""
    counts = split_by_share(episodes, shares)
    if episodes >= len(counts):
        for i, n in enumerate(counts):
            if n == 0:
                counts[max(range(len(counts)), key=counts.__getitem__)] -= 1
                counts[i] = 1
    return counts


def plan_eval(cfg: RunConfig, episodes: int, tag: str = "eval") -> list[EpisodeSpec]:
    """Held-out seeds (offset past every training seed), split across tasks by share, at
    least one per task (`eval_counts`), so evaluation reports every task's success."""
    specs: list[EpisodeSpec] = []
    counts = eval_counts(episodes, [t.share for t in cfg.tasks])
    for task, n in zip(cfg.tasks, counts, strict=True):
        for i in range(n):
            seed = cfg.seed if task.seeds == "fixed" else task.eval_seed_offset + i
            name = eval_id(tag, task.name, i)
            specs.append(EpisodeSpec(task, seed, name, name))
    return specs


def plan_namer(cfg: RunConfig) -> Callable[[str, int], tuple[str, int]]:
    """(task, n) -> the n-th group of that task in the plan: iteration n // quota, slot
    n % quota (same ids and seeds as `plan_iteration`, so ledgers and shards read the same in
    synchronous and async runs)."""
    counts = split_by_share(cfg.rollout.num_groups, [t.share for t in cfg.tasks])
    tasks = {t.name: (t, q) for t, q in zip(cfg.tasks, counts, strict=True)}

    def name(task: str, n: int) -> tuple[str, int]:
        cfg_task, quota = tasks[task]
        iteration, g = divmod(n, quota)
        return group_id(task, iteration, g), group_seed(cfg, cfg_task, iteration, g)

    return name


def plan_resampler(cfg: RunConfig) -> Callable[[str, int], tuple[str, int]]:
    """(first group id of a batch slot, try k >= 1) -> (id, seed) of the slot's k-th
    replacement (`rollout.resample_uniform`): group index g + k * num_groups of the same task
    and iteration, past every planned index, so ids stay unique, parseable and the same in
    every run of the config (and across rollout shards, which name the plan's own slots)."""
    tasks = {t.name: t for t in cfg.tasks}

    def name(first: str, k: int) -> tuple[str, int]:
        task, iteration, g = parse_group_id(first)
        index = g + k * cfg.rollout.num_groups
        return group_id(task, iteration, index), group_seed(cfg, tasks[task], iteration, index)

    return name
