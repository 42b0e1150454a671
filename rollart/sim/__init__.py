"""Discrete-event simulator: the real rollout scheduler (and, in `system`, the real Router)
under modelled engines, envs, rewards, trainer and weight sync.

For capacity planning (which max_staleness, how many engines, what batching, which pools) before
renting hardware; rollart.sim.validate checks it against our measured benchmarks and
benchmarks/sim_cluster.py extrapolates to 64-3,072 GPUs.
"""

from rollart.sim.cluster import (
    EnvModel,
    ModelSpec,
    PoolModel,
    RoutingModel,
    SyncModel,
    SystemConfig,
    TrainModel,
)
from rollart.sim.rewards import RewardModel, RewardPool
from rollart.sim.simulator import SimResult, SimStalled, Simulation, simulate
from rollart.sim.system import SystemResult, SystemSimulation, simulate_system
from rollart.sim.workload import (
    EngineModel,
    EpisodePlan,
    SimConfig,
    SimConfigError,
    TaskModel,
    TrainerModel,
    sample_plan,
)

__all__ = ["EngineModel", "EnvModel", "EpisodePlan", "ModelSpec", "PoolModel", "RewardModel",
           "RewardPool", "RoutingModel", "SimConfig", "SimConfigError", "SimResult", "SimStalled",
           "Simulation", "SyncModel", "SystemConfig", "SystemResult", "SystemSimulation",
           "TaskModel", "TrainModel", "TrainerModel", "sample_plan", "simulate",
           "simulate_system"]
