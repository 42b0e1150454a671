"""Reward handlers with the AWS Lambda Python signature `handler(event, context) -> dict`.

Each handler is a pure function of its event, importable and testable as a plain function; the
same module is what gets packaged for Lambda (`handler_path(name)` gives the Lambda `Handler`
string). Events carry only what scoring needs (JSON-safe). Names map to handlers in the static
table `rollart.rewards.registry.BUILTINS`; handler modules never import the registry. The
built-ins live in small modules that import their heavy dependencies (sympy, torch) lazily,
inside the handler, so a worker that serves `env_outcome` starts in ~0.1 s:

| name          | module                              | scores                                    |
|---------------|-------------------------------------|-------------------------------------------|
| env_outcome   | here                                | task return + mean format penalty         |
| success       | here                                | 1 for a successful episode                |
| format        | rollart.rewards.format_reward       | `<answer>...</answer>` format, graded     |
| math          | rollart.rewards.math_reward         | math-verify answer equivalence            |
| code_exec     | rollart.rewards.code_exec           | untrusted code vs tests, sandboxed        |
| reward_model  | rollart.rewards.model_reward        | a small classifier loaded in the function |
| sleep / raise / exit | rollart.rewards.diagnostic   | load tests and endpoint tests             |
"""

from __future__ import annotations

from typing import Any


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


def success_only(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """1.0 for a successful episode, 0.0 otherwise (ignores format penalties)."""
    ok = float(bool(event.get("success", False)))
    return {"reward": ok, "success": ok}
