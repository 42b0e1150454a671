"""Long-lived services held on their hardware-class workers for the whole run (Dask actors in a
run, plain objects in the in-process mode): the engine replicas, the trainer and the rollout
service. The env hosts live with the rollout code (`rollart/rollout/env_host.py`)."""

from rollart.services.engine import EngineService
from rollart.services.rollout import RolloutServiceActor
from rollart.services.trainer import TrainerService

__all__ = ["EngineService", "RolloutServiceActor", "TrainerService"]
