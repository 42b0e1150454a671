"""What a system simulation reports: per-step critical-path breakdown, pools, router, rewards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollart.sim.simulator import SimResult

PARTS = ("generation", "env_step", "env_startup", "reward", "training", "sync", "idle")


@dataclass
class EpisodeLife:
    """What one episode spent its time on (for the step breakdown)."""

    start: float
    startup_s: float = 0.0
    gen_s: float = 0.0  # queued for or inside generate calls
    env_s: float = 0.0
    end: float = 0.0
    tokens: float = 0.0  # prompt + generated tokens of the whole conversation


@dataclass
class SystemResult:
    sim: SimResult
    steps: list[dict[str, Any]]  # per update: step_s, seconds per PARTS entry, episode_mix
    pool_util: dict[str, float]  # engine pools and the trainer: busy fraction of wall
    router: dict[str, float]
    reward: dict[str, float]
    events: int  # rollout-service events (routes, completions, env steps, episode lifecycle)

    def mean_step(self, skip: int = 1) -> dict[str, float]:
        """Mean step time and breakdown over updates after the first `skip` (warm-up)."""
        steps = self.steps[skip:] or self.steps
        keys = ["step_s", *PARTS]
        return {k: sum(s[k] for s in steps) / len(steps) for k in keys}

    def summary(self) -> dict[str, Any]:
        m = self.mean_step()
        steps = self.steps[1:] or self.steps
        mix = {k: sum(s["episode_mix"][k] for s in steps) / len(steps)  # type: ignore[index]
               for k in ("env_startup", "generation", "env_step")} if steps else {}
        return {"step_s": m["step_s"], "episode_mix": mix,
                "breakdown": {k: m[k] / m["step_s"] if m["step_s"] else 0.0 for k in PARTS},
                "wall_s": self.sim.wall_s, "updates": self.sim.updates,
                "pool_util": self.pool_util,
                "events_per_s": self.events / self.sim.wall_s if self.sim.wall_s else 0.0,
                "router": self.router, "reward": self.reward,
                "mean_staleness": self.sim.summary()["mean_staleness"],
                "counters": self.sim.counters}
