"""Checks of `tasks:` that need more than one task's fields: env ids, shares against the batch.

Part of the `rollart.config` package (`RunConfig`'s validator calls `check_tasks`), to keep
modules small. Errors are `KeyedValueError`s: the config's one-line error then names the exact
key (`tasks.1.env_id`), not the whole config.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollart.config.training import TaskConfig

def split_by_share(total: int, shares: list[float]) -> list[int]:
    """Largest-remainder split of `total` items by relative shares (sums exactly to total)."""
    weight = sum(shares)
    raw = [total * s / weight for s in shares]
    counts = [math.floor(x) for x in raw]
    order = sorted(range(len(shares)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


# The ids and id prefixes rollart.envs registers with `@register_env`. Known here as data:
# rollart.envs imports rollart.config (TaskConfig), so importing the registry from a config
# validator would be an import cycle (tests/unit/test_architecture.py). Builders registered in
# this process before the config loads (rollart.envs.registry.ENV_BUILDERS) count too, and
# tests/unit/test_config_tasks.py checks this list against the registry.
BUILTIN_ENV_IDS = ("CliffWalking", "FrozenLake", "Taxi", "arith", "calculator", "guess")


class KeyedValueError(ValueError):
    """A config error about one key (dotted path) deeper than the validator that found it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _registered() -> set[str]:
    """Builtin keys, plus any builder registered in this process (a plugin, a test)."""
    keys = set(BUILTIN_ENV_IDS)
    registry = sys.modules.get("rollart.envs.registry")  # never imported from here: see above
    if registry is not None:
        keys |= set(getattr(registry, "ENV_BUILDERS", {}))
    return keys


def env_id_known(env_id: str) -> bool:
    """What rollart.envs.registry.find_builder accepts: a registered id, an id starting with a
    registered prefix, or any id gymnasium knows."""
    if any(env_id == key or env_id.startswith(key) for key in _registered()):
        return True
    import gymnasium

    return env_id in gymnasium.registry


def known_env_ids() -> list[str]:
    """For the error message: registered ids and prefixes, then gymnasium's toy-text ids."""
    import gymnasium

    toy_text = [env_id for env_id, spec in gymnasium.registry.items()
                if isinstance(spec.entry_point, str) and ".toy_text." in spec.entry_point]
    return sorted(_registered()) + sorted(toy_text)


def check_tasks(tasks: Sequence[TaskConfig], num_groups: int) -> None:
    """Every task's env id is known (an unknown one would otherwise fail only once a worker
    builds the env, after the cluster and the Prefect flow started), and every task gets at
    least one group of each batch."""
    for i, task in enumerate(tasks):
        if not env_id_known(task.env_id):
            raise KeyedValueError(
                f"tasks.{i}.env_id",
                f"unknown env id {task.env_id!r}: use one of {', '.join(known_env_ids())} (or a "
                "gymnasium id, or an id registered with rollart.envs.register_env)")
    # Each share is > 0 (TaskConfig), so they sum to a positive number; what remains to check
    # is that the split of a batch leaves no task out.
    counts = split_by_share(num_groups, [t.share for t in tasks])
    for i, (task, n) in enumerate(zip(tasks, counts, strict=True)):
        if n == 0:
            raise KeyedValueError(
                f"tasks.{i}.share",
                f"task {task.name!r} (share {task.share:g}) gets none of the "
                f"rollout.num_groups={num_groups} groups of a batch (split by share: {counts}), "
                "so it would never train: raise its share or rollout.num_groups")
