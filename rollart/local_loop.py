"""The in-process mode: the iteration driver (`rollart/driver.py`) with every stage a plain call
and every service a plain object in this process. No cluster, no Prefect server: benchmarks and
unit tests run the same loop as the Prefect flow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollart.config import RunConfig
from rollart.driver import InProcessRunner, IterationDriver, IterationResult
from rollart.metrics import summary_row
from rollart.rollout.env_host import EnvHost
from rollart.rollout.setup import build_rollout_service
from rollart.rollout.shards import ShardedRollout
from rollart.run import RunSpec
from rollart.services import EngineService, TrainerService
from rollart.storage.background import flush_all
from rollart.storage.lock import run_lock
from rollart.storage.resume import prepare_resume


class LocalServices:
    """Services as plain objects; one env host in this process (its episodes run on the
    rollout service's threads, so they keep flowing while the trainer trains)."""

    def __init__(self, run: RunSpec) -> None:
        self.run = run

    def trainer(self) -> TrainerService:
        if self.run.cfg.train.world_size > 1:  # ranks are processes: a cluster's workers
            raise ValueError("train.world_size > 1 runs its trainer ranks on Dask workers; the "
                             "in-process mode has one process: drop --in-process or set "
                             "train.world_size=1")
        return TrainerService(self.run)

    def engines(self) -> list[EngineService]:
        cfg = self.run.cfg
        replicas = len(cfg.cluster.engine_classes(cfg.engine.replicas))
        return [EngineService(self.run, r) for r in range(replicas)]

    def env_hosts(self) -> list[EnvHost]:
        return [EnvHost(self.run.cfg.tasks)]

    def rollout(self, engines: list[Any], hosts: list[Any], version: int) -> Any:
        n = self.run.cfg.rollout.shards  # in one process the shards share its GIL: for tests
        if n == 1:
            return build_rollout_service(self.run, engines, hosts, version)
        return ShardedRollout([build_rollout_service(self.run, engines, hosts, version, (k, n))
                               for k in range(n)])

    def host_stats(self, hosts: list[Any]) -> list[dict[str, Any] | None]:
        return [h.stats() for h in hosts]

    def flush_shards(self) -> int:
        return flush_all()


def run_local(cfg: RunConfig, run_id: str, on_iteration: Callable[[dict], None] | None = None,
              eval_every: int | None = None,
              stop_when: Callable[[list[float]], bool] | None = None,
              resume: bool = False) -> dict[str, Any]:
    """Run `cfg.iterations` iterations; `on_iteration(summary row)` after each;
    `stop_when(greedy eval history)` may end the run early. `resume`: continue run `run_id`
    from its latest complete checkpoint (exact resume)."""
    run = RunSpec(cfg, run_id)
    with run_lock(cfg.storage, run_id):  # one writer per run id, released on abort too
        return _run_locked(run, on_iteration, eval_every, stop_when, resume)


def _run_locked(run: RunSpec, on_iteration: Callable[[dict], None] | None,
                eval_every: int | None, stop_when: Callable[[list[float]], bool] | None,
                resume: bool) -> dict[str, Any]:
    run_id = run.run_id
    point = prepare_resume(run.store()) if resume else None
    services = LocalServices(run)
    driver = IterationDriver(run, InProcessRunner(), services, eval_every=eval_every)
    t_start = time.perf_counter()
    try:
        first = driver.start(point.step if point else None)

        def report(res: IterationResult) -> None:
            if on_iteration is not None:
                on_iteration(summary_row(res.metrics))

        curve = driver.iterations(first, report, stop_when)
        done = driver.finish()
    except BaseException:
        driver.abort()
        raise
    assert driver.svc is not None
    return {"run_id": run_id, "store": driver.store.url, "curve": curve,
            "uploads": done["uploads"], "resumed_from": point.step if point else None,
            "wall_s": time.perf_counter() - t_start, "trainer": driver.svc.trainer,
            "engines": driver.svc.engines, "rollout": done["rollout"]}
