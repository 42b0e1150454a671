"""Pure planning of which episodes an iteration runs: groups per task, seeds, sample ids."""

from __future__ import annotations

import random

from rollart.config import RunConfig, TaskConfig
from rollart.rollout.env_manager import EpisodeSpec
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
            group_id = f"{task.name}/i{iteration}/g{g}"
            for m in range(cfg.rollout.group_size):
                specs.append(EpisodeSpec(task, seed, group_id, f"{group_id}/m{m}", iteration))
    return specs


def plan_eval(cfg: RunConfig, episodes: int, tag: str = "eval") -> list[EpisodeSpec]:
    """Held-out seeds (offset past every training seed), split across tasks by share."""
    specs: list[EpisodeSpec] = []
    counts = split_by_share(episodes, [t.share for t in cfg.tasks])
    for task, n in zip(cfg.tasks, counts, strict=True):
        for i in range(n):
            seed = cfg.seed if task.seeds == "fixed" else task.eval_seed_offset + i
            name = f"{tag}/{task.name}/{i}"
            specs.append(EpisodeSpec(task, seed, name, name))
    return specs
