"""Adaptive scaling of one hardware class (the env pool) that never retires a service's worker.

Dask's own `Adaptive` counts every worker of the cluster and may retire any idle one; in a run
the idle-looking workers are exactly the ones holding the long-lived services (trainer, engines,
env hosts, rollout service: Dask actors, whose calls are not tasks and so never show as
"processing"). Retiring one loses the service. Here:

- `may_retire(ws, hw_class)`: a worker may go only if it is of the scaled class, holds no
  actor and runs nothing;
- `KeepServiceWorkers`: a scheduler plugin applying that rule to every scale-down decision the
  scheduler makes (`workers_to_close`, used by `retire_workers(n=...)` and by external
  autoscalers such as the Kubernetes operator's); preload it with
  `dask scheduler --preload infra.scaling` (reads ROLLART_ADAPT_CLASS, default CPU);
- `ClassAdaptive`: `Adaptive` for a cluster object that owns only that class's workers (the
  Slurm manager's env pool): wanted workers = the class's queued work / target duration.
"""

from __future__ import annotations

import math
import os
from typing import Any

from distributed.deploy.adaptive import Adaptive
from distributed.diagnostics.plugin import SchedulerPlugin


def may_retire(ws: Any, hw_class: str) -> bool:
    """`ws` (a scheduler WorkerState) can be retired without losing a service or a task."""
    return hw_class in ws.resources and not ws.actors and not ws.processing


class KeepServiceWorkers(SchedulerPlugin):
    """Restricts the scheduler's scale-down candidates to idle, actor-free workers of one class."""

    name = "rollart-keep-service-workers"

    def __init__(self, hw_class: str = "CPU") -> None:
        self.hw_class = hw_class

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        return [ws for ws in workers if may_retire(ws, self.hw_class)]


def dask_setup(scheduler: Any) -> None:
    """`dask scheduler --preload infra.scaling`: install KeepServiceWorkers."""
    scheduler.add_plugin(KeepServiceWorkers(os.environ.get("ROLLART_ADAPT_CLASS", "CPU")))


class ClassAdaptive(Adaptive):
    """Adaptive scaling of the workers `cluster` launches (all of class `hw_class`), between
    `minimum` and `maximum`. The scheduler must run in this process (`cluster.scheduler`): the
    Slurm manager's SLURMCluster starts it here."""

    def __init__(self, cluster: Any, hw_class: str, target_duration_s: float = 5.0,
                 **kwargs: Any) -> None:
        self.hw_class, self.target_duration_s = hw_class, target_duration_s
        super().__init__(cluster, **kwargs)

    def _class_workers(self) -> list[Any]:
        return [ws for ws in self.cluster.scheduler.workers.values()
                if self.hw_class in ws.resources]

    async def target(self) -> int:
        # Occupancy = expected seconds of the work assigned to the class's workers (tasks
        # annotated with the class queue on them); clamped to [minimum, maximum] by the caller.
        occupancy = sum(ws.occupancy for ws in self._class_workers())
        return math.ceil(occupancy / self.target_duration_s)

    async def workers_to_close(self, target: int) -> list[str]:
        n = len(self.plan) - target
        names = [ws.name for ws in self._class_workers()
                 if ws.name in self.plan and may_retire(ws, self.hw_class)]
        # The newest go first: `CPU-10` sorts after `CPU-9` by (length, name).
        return sorted(names, key=lambda s: (len(str(s)), str(s)), reverse=True)[:max(n, 0)]
