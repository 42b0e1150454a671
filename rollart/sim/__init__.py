"""Discrete-event simulator: the real rollout scheduler under modelled engines, envs, trainer.

For capacity planning (which max_staleness, how many engines, what batching) before renting
hardware; benchmarks/sim_async.py checks it against the measured async-vs-sync benchmark.
"""

from rollart.sim.simulator import SimResult, SimStalled, Simulation, simulate
from rollart.sim.workload import (
    EngineModel,
    EpisodePlan,
    SimConfig,
    SimConfigError,
    TaskModel,
    TrainerModel,
    sample_plan,
)

__all__ = ["EngineModel", "EpisodePlan", "SimConfig", "SimConfigError", "SimResult",
           "SimStalled", "Simulation", "TaskModel", "TrainerModel", "sample_plan", "simulate"]
