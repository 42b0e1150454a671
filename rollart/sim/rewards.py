"""Reward scoring capacity: a fixed pool of warm workers, or serverless functions.

Pure and event-free: `submit(t, cost_s)` returns when the score is back, given every earlier
submission (submissions come in time order, as the simulator's events do). Requests are served
first come, first served; an instance serves one request at a time (as a Lambda instance does).

    fixed       `workers` instances, warm from the start, never reclaimed
    serverless  up to `workers` concurrent instances (the function's concurrency limit); a request
                that finds no idle instance starts a new one (cold start) while under the limit,
                else waits for the first instance to free up (a throttled client retrying); an
                instance idle for more than `idle_s` is reclaimed (scale to zero)

done = start + overhead_s + cost_s, with start = t (warm instance idle), t + cold_start_s (new
instance) or the earliest instance's free time (at the limit).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from rollart.config import LatencyConfig
from rollart.sim.workload import SimConfigError


@dataclass(frozen=True)
class RewardModel:
    """How episodes are scored. Defaults: serverless, AWS Lambda's default account concurrency
    quota (1,000 per region, AWS Lambda quotas page), a ~0.5 s Python cold start (AWS reports
    typical cold starts from under 100 ms to over 1 s; 0.5 s is an assumption in that range),
    instances kept ~10 minutes after use (AWS does not document it; 5-15 min is the folklore).
    `cost` is the scoring time per episode (a verifier or sandboxed test run)."""

    kind: Literal["fixed", "serverless"] = "serverless"
    workers: int = 1000
    cost: LatencyConfig = field(default_factory=lambda: LatencyConfig(median_s=1.0, sigma=0.5))
    cold_start_s: float = 0.5
    idle_s: float = 600.0
    overhead_s: float = 0.0  # per invocation (client, network, runtime)

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "serverless"):
            raise SimConfigError(f"reward.kind must be 'fixed' or 'serverless' (got {self.kind!r})")
        if self.workers < 1:
            raise SimConfigError(f"reward.workers must be >= 1 (got {self.workers})")
        if min(self.cold_start_s, self.idle_s, self.overhead_s) < 0:
            raise SimConfigError("reward: cold_start_s, idle_s and overhead_s must be >= 0")


class RewardPool:
    def __init__(self, model: RewardModel) -> None:
        self.m = model
        # Free times of the live instances (min-heap). A fixed pool starts with all of them warm.
        self.free: list[float] = [0.0] * model.workers if model.kind == "fixed" else []
        self.cold_starts = 0
        self.busy_s = 0.0  # instance-seconds spent serving (cold starts included)
        self.peak = len(self.free)
        self._last_t = 0.0

    def submit(self, t: float, cost_s: float) -> float:
        if t < self._last_t:
            raise ValueError("RewardPool.submit: submissions must come in time order")
        self._last_t = t
        m = self.m
        if m.kind == "serverless":
            while self.free and self.free[0] + m.idle_s < t:  # idle too long: reclaimed
                heapq.heappop(self.free)
        if self.free and self.free[0] <= t:
            heapq.heappop(self.free)
            start = begun = t
        elif len(self.free) < m.workers:  # only serverless gets here: scale out
            begun, start = t, t + m.cold_start_s
            self.cold_starts += 1
        else:
            start = begun = heapq.heappop(self.free)
        done = start + m.overhead_s + cost_s
        heapq.heappush(self.free, done)
        self.peak = max(self.peak, len(self.free))
        self.busy_s += done - begun
        return done
