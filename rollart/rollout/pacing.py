"""How many groups each slice of a paced fill may start (the asyncio runner's start pacing).

Pure: times in, counts out; `RolloutService._fill_slice` carries the decisions out on the loop.
A fill starts new episodes at `rate` per second at most: its first slice holds `burst_s` of the
rate, each later slice the whole groups the rate allows since the previous slice plus what was
left of a group before (a group is `per_group` episodes: group_size + redundancy).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StartPacer:
    rate: float  # episodes per second
    burst_s: float  # the first slice of a fill: this much of the rate
    per_group: int  # episodes one group starts
    budget: float = 0.0  # episodes allowed and not started (less than a group carries over)
    last: float = 0.0  # time of the previous slice

    def allowed(self, now: float, continued: bool) -> int:
        """Whole groups the slice at time `now` may start (`continued`: a later slice of the
        same fill). A slice late by more than 1 s (a loop saturated for that long) gets 1 s of
        the rate, not a flood."""
        if continued:
            self.budget += min(now - self.last, 1.0) * self.rate
        else:
            self.budget = self.burst_s * self.rate
        self.last = now
        return int(self.budget // self.per_group)

    def started(self, groups: int) -> None:
        """The slice started `groups` groups (fewer than allowed: admission is full)."""
        self.budget -= groups * self.per_group
