"""Stage spans: each stage body records when it ran (wall clock, measured where it ran), so the
driver can split an iteration into stage work and orchestration (task submission and state
tracking, scheduling, actor round trips, serialisation) whatever runs the stages.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
SPAN = "span"  # key in a stage's info dict: (start, end), time.time() seconds


def info_of(result: Any) -> dict[str, Any] | None:
    """A stage's info dict: the second item of `(trajectories, info)`, or the dict itself."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result[1]
    return result if isinstance(result, dict) else None


def timed_stage(fn: F) -> F:
    """Record the body's (start, end) in its info dict. Wall clock (`time.time`), since the
    stages of one iteration run in several processes of one machine or cluster."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        out = fn(*args, **kwargs)
        info = info_of(out)
        if info is not None:
            info[SPAN] = (t0, time.time())
        return out

    return wrapper  # type: ignore[return-value]


def busy_seconds(spans: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `spans` clipped to [start, end] (concurrent stages count once)."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a  # type: ignore[operator]
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a  # type: ignore[operator]
    return total
