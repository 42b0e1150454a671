"""Diagnostic handlers for load tests and for testing endpoints and clients end to end.

`sleep` stands in for a reward of known cost (benchmarks/reward_elastic.py); `raise` and `exit`
exercise the error paths (an unhandled exception, a runtime that dies mid-invocation);
`rollart.rewards.diagnostic.allocate` (by its path) a handler that needs more memory than its
limit allows.
"""

from __future__ import annotations

import os
import time
from typing import Any

MAX_SLEEP_S = 900.0  # the Lambda maximum; keeps a typo from parking a worker forever


def sleep_reward(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Sleeps `cost_s` seconds, then returns `reward` (default 1.0). Costs no CPU."""
    cost = min(max(float(event.get("cost_s", 0.1)), 0.0), MAX_SLEEP_S)
    time.sleep(cost)
    return {"reward": float(event.get("reward", 1.0)), "cost_s": cost, "pid": float(os.getpid())}


def raise_error(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Raises ValueError with `message`: a handler bug as Lambda reports it."""
    raise ValueError(str(event.get("message", "reward handler failed on purpose")))


def exit_runtime(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Kills its own process (exit status `code`) mid-invocation: a crashed runtime."""
    os._exit(int(event.get("code", 3)))


def allocate(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Allocates and touches `mb` MiB (default 64), then returns `reward` (default 1.0)."""
    mb = min(max(int(event.get("mb", 64)), 0), 1 << 16)
    block = bytearray(mb << 20)  # zero-filled: every page is written
    return {"reward": float(event.get("reward", 1.0)), "mb": float(len(block) >> 20)}
