"""Registry of reward handlers by short name ("env_outcome", "math", ...).

Kept free of heavy imports: a Lambda worker imports exactly one handler module, and the registry
must not pull torch or sympy into a cold start that does not need them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]
HANDLERS: dict[str, Handler] = {}


def register_handler(name: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        return fn

    return deco


def _load_builtins() -> None:
    importlib.import_module("rollart.rewards.handlers")  # registers every built-in


def get_handler(name: str) -> Handler:
    """A registered name, or a dotted `package.module.function` path (custom handlers)."""
    _load_builtins()
    if name in HANDLERS:
        return HANDLERS[name]
    if "." in name:
        modname, _, attr = name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(modname), attr)
        except (ImportError, AttributeError) as err:
            raise KeyError(f"cannot import reward handler {name!r}: {err}") from None
        if callable(fn):
            return fn
    raise KeyError(f"unknown reward function {name!r}; known: {sorted(HANDLERS)}")


def handler_path(name: str) -> str:
    """The `module.function` string awslambdaric (and the Lambda `Handler` field) expects."""
    fn = get_handler(name)
    return f"{fn.__module__}.{fn.__name__}"


def known_handler(name: str) -> bool:
    _load_builtins()
    return name in HANDLERS or "." in name


def response_of(event: dict[str, Any]) -> str:
    """The text to score: `response`, else the episode's `final_response` (see reward_event)."""
    text = event.get("response")
    if text is None:
        text = event.get("final_response", "")
    return str(text)
