"""Reward handlers with the AWS Lambda Python signature `handler(event, context) -> dict`.

Each handler is a pure function of its event, importable and testable as a plain function; the
same module is what gets packaged for Lambda. Events carry only what scoring needs (JSON-safe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]
HANDLERS: dict[str, Handler] = {}


def register_handler(name: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        return fn

    return deco


def get_handler(name: str) -> Handler:
    if name not in HANDLERS:
        raise KeyError(f"unknown reward function {name!r}; known: {sorted(HANDLERS)}")
    return HANDLERS[name]


@register_handler("env_outcome")
def env_outcome(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Task return plus the format penalty *averaged* over turns.

    Averaging (not summing) keeps the format term independent of episode length: a summed
    per-turn penalty pays the policy to end episodes early, e.g. by walking into a hole.

    event: {"task_return": float, "format_penalty": float (sum over turns, <= 0),
            "num_turns": int, "success": bool, "format_errors": int}
    """
    turns = max(int(event.get("num_turns", 0)), 1)
    task = float(event.get("task_return", 0.0))
    fmt = float(event.get("format_penalty", 0.0)) / turns
    return {
        "reward": task + fmt,
        "task": task,
        "format": fmt,
        "success": float(bool(event.get("success", False))),
        "format_errors": float(event.get("format_errors", 0)),
    }


@register_handler("success")
def success_only(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """1.0 for a successful episode, 0.0 otherwise (ignores format penalties)."""
    ok = float(bool(event.get("success", False)))
    return {"reward": ok, "success": ok}
