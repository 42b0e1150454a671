"""Map a task's `env_id` to an `Env` builder.

`ENV_BUILDERS` maps an exact id or an id prefix to a builder `(TaskConfig) -> Env`; the longest
matching key wins. Ids that no key matches but gymnasium knows go to `ToyTextEnv`. Later modules
add kinds with the decorator::

    @register_env("reasoning_gym/")
    def build_reasoning_gym(task: TaskConfig) -> Env: ...
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium

from rollart.config import TaskConfig
from rollart.envs.base import Env
from rollart.envs.toytext import ToyTextEnv

EnvBuilder = Callable[[TaskConfig], Env]
ENV_BUILDERS: dict[str, EnvBuilder] = {}


def register_env(prefix_or_id: str) -> Callable[[EnvBuilder], EnvBuilder]:
    """Decorator: route env ids equal to, or starting with, `prefix_or_id` to the builder."""
    if not prefix_or_id:
        raise ValueError("register_env needs a non-empty id or prefix")

    def decorate(builder: EnvBuilder) -> EnvBuilder:
        ENV_BUILDERS[prefix_or_id] = builder
        return builder

    return decorate


@register_env("FrozenLake")
@register_env("CliffWalking")
@register_env("Taxi")
def build_gymnasium(task: TaskConfig) -> Env:
    """A gymnasium env behind `ToyTextEnv`; `env_kwargs["action_names"]` overrides the names."""
    kwargs = dict(task.env_kwargs)
    action_names = kwargs.pop("action_names", None)
    return ToyTextEnv(
        task.env_id,
        kwargs,
        max_turns=task.max_turns,
        format_penalty=task.format_penalty,
        parser=task.parser,
        action_names=action_names,
        format_credit=task.format_credit,
    )


def find_builder(env_id: str) -> EnvBuilder | None:
    """The builder for `env_id`: exact key, else longest prefix, else gymnasium, else None."""
    if env_id in ENV_BUILDERS:
        return ENV_BUILDERS[env_id]
    prefixes = [key for key in ENV_BUILDERS if env_id.startswith(key)]
    if prefixes:
        return ENV_BUILDERS[max(prefixes, key=len)]
    if env_id in gymnasium.registry:
        return build_gymnasium
    return None


def known_env_ids() -> list[str]:
    """Registered keys plus gymnasium's toy-text ids (for error messages and CLIs)."""
    toy_text = [
        env_id
        for env_id, spec in gymnasium.registry.items()
        if isinstance(spec.entry_point, str) and ".toy_text." in spec.entry_point
    ]
    return sorted(ENV_BUILDERS) + sorted(toy_text)


def make_env(task: TaskConfig) -> Env:
    """Build the environment of one task; ValueError naming the id if nothing knows it."""
    builder = find_builder(task.env_id)
    if builder is None:
        raise ValueError(
            f"unknown env_id {task.env_id!r}: known ids and prefixes are "
            f"{', '.join(known_env_ids())} (or any id registered in gymnasium)"
        )
    env = builder(task)
    if task.latency is not None:
        from rollart.envs.wrappers import LatencyEnv

        env = LatencyEnv(env, task.latency)
    if task.faults is not None:
        from rollart.envs.wrappers import FaultEnv

        env = FaultEnv(env, task.faults, task.name)
    return env
