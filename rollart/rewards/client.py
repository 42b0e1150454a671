"""Reward clients: turn finished trajectories into events, call a handler, attach the reward."""

from __future__ import annotations

import time
from typing import Any, Protocol

from rollart.rewards.handlers import get_handler
from rollart.types import Trajectory


def reward_event(traj: Trajectory) -> dict[str, Any]:
    return {
        "sample_id": traj.sample_id,
        "task": traj.task,
        "env_return": traj.env_return,
        "task_return": traj.task_return,
        "format_penalty": traj.format_penalty,
        "success": traj.success,
        "format_errors": traj.format_errors,
        "num_turns": traj.num_turns,
        "final_response": traj.turns[-1].response if traj.turns else "",
    }


class RewardClient(Protocol):
    def score(self, trajs: list[Trajectory]) -> list[Trajectory]: ...


class LocalRewardClient:
    """Runs the handler in-process (the embedded default before the Lambda backend)."""

    def __init__(self, function: str = "env_outcome") -> None:
        self.function = function
        self.handler = get_handler(function)

    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        for traj in trajs:
            t0 = time.perf_counter()
            result = self.handler(reward_event(traj), None)
            traj.reward = float(result["reward"])
            traj.reward_details = {k: float(v) for k, v in result.items() if k != "reward"}
            traj.timings["reward_s"] = time.perf_counter() - t0
        return trajs
