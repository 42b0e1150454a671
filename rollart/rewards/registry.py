"""Registry of reward handlers by short name ("env_outcome", "math", ...).

The built-ins are a static table of name -> "module.function" (the string the Lambda `Handler`
field and awslambdaric take), resolved on first use. The handler modules import nothing from
here, so there is no registry <-> handlers cycle, and resolving a name imports exactly the one
module that defines it: a Lambda worker never pulls torch or sympy into a cold start that does
not need them. Other handlers are registered with `@register_handler(name)` or named by their
dotted `package.module.function` path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from rollart.rewards.events import response_of

__all__ = ["BUILTINS", "HANDLERS", "Handler", "get_handler", "handler_path", "known_handler",
           "register_handler", "response_of"]

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]

BUILTINS: Mapping[str, str] = MappingProxyType({
    "env_outcome": "rollart.rewards.handlers.env_outcome",
    "success": "rollart.rewards.handlers.success_only",
    "format": "rollart.rewards.format_reward.format_reward",
    "math": "rollart.rewards.math_reward.math_answer",
    "code_exec": "rollart.rewards.code_exec.code_exec",
    "reward_model": "rollart.rewards.model_reward.reward_model",
    "sleep": "rollart.rewards.diagnostic.sleep_reward",
    "raise": "rollart.rewards.diagnostic.raise_error",
    "exit": "rollart.rewards.diagnostic.exit_runtime",
})
_REGISTERED: dict[str, Handler] = {}


def _resolve(path: str) -> Handler:
    modname, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(modname), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise KeyError(f"cannot import reward handler {path!r}: {err}") from None
    if not callable(fn):
        raise KeyError(f"reward handler {path!r} is not callable")
    return fn


class _Handlers(Mapping[str, Handler]):
    """Every known name -> its handler; a built-in's module is imported on lookup only."""

    def __getitem__(self, name: str) -> Handler:
        if name in _REGISTERED:
            return _REGISTERED[name]
        return _resolve(BUILTINS[name])

    def __contains__(self, name: object) -> bool:
        return name in BUILTINS or name in _REGISTERED

    def __iter__(self) -> Iterator[str]:
        return iter([*BUILTINS, *_REGISTERED])

    def __len__(self) -> int:
        return len(BUILTINS) + len(_REGISTERED)


HANDLERS: Mapping[str, Handler] = _Handlers()


def register_handler(name: str) -> Callable[[Handler], Handler]:
    """Decorator: add a handler under `name`. A name that is taken (a built-in or an earlier
    registration) raises, as the policy-loss registry does: silently replacing a reward would
    change what a run optimises."""

    def deco(fn: Handler) -> Handler:
        if name in HANDLERS:
            raise ValueError(f"reward handler {name!r} is already registered")
        _REGISTERED[name] = fn
        return fn

    return deco


def get_handler(name: str) -> Handler:
    """A registered name, or a dotted `package.module.function` path (custom handlers)."""
    if name in HANDLERS:
        return HANDLERS[name]
    if "." in name:
        return _resolve(name)
    raise KeyError(f"unknown reward function {name!r}; known: {sorted(HANDLERS)}")


def handler_path(name: str) -> str:
    """The `module.function` string awslambdaric (and the Lambda `Handler` field) expects."""
    if name in BUILTINS:
        return BUILTINS[name]
    fn = get_handler(name)
    return f"{fn.__module__}.{fn.__name__}"


def known_handler(name: str) -> bool:
    return name in HANDLERS or "." in name
