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
    total, reach = 0.0, start
    for a, b in sorted(spans):  # by start: each span adds only what lies past `reach`
        b = min(b, end)
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total
