"""The in-process mode: the iteration driver (`rollart/runner/driver.py`) with every stage a plain
call and every service a plain object in this process. No cluster, no Prefect server: benchmarks and
unit tests run the same loop as the Prefect flow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollart.config import RunConfig
from rollart.metrics import summary_row
from rollart.rollout.env_host import EnvHost
from rollart.rollout.setup import build_rollout_service
from rollart.rollout.shards import ShardedRollout
from rollart.run import RunSpec
from rollart.runner.driver import InProcessRunner, IterationDriver, IterationResult
from rollart.runner.lifecycle import run_lifecycle
from rollart.services import EngineService, TrainerService
from rollart.storage.background import flush_all


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


IN_PROCESS_RESUME_HINT = "resume=True"


def run_local(cfg: RunConfig, run_id: str, on_iteration: Callable[[dict], None] | None = None,
              eval_every: int | None = None,
              stop_when: Callable[[list[float]], bool] | None = None,
              resume: bool = False) -> dict[str, Any]:
    """Run `cfg.iterations` iterations; `on_iteration(summary row)` after each;
    `stop_when(greedy eval history)` may end the run early. `resume`: continue run `run_id`
    from its latest complete checkpoint (exact resume), with `cfg` as the run's config.

    The flow's lifecycle (`rollart/runner/lifecycle.py`): the run's lock, the store check, a run id
    that has checkpoints refused unless `resume`, a resume refused when `cfg` changes a
    plan-defining key of the stored run config. No restarts: the services live in this
    process, so a failure aborts the run and propagates."""

    def make_driver(run: RunSpec, attempt: int) -> IterationDriver:
        return IterationDriver(run, InProcessRunner(), LocalServices(run), eval_every=eval_every)

    def report(res: IterationResult) -> None:
        if on_iteration is not None:
            on_iteration(summary_row(res.metrics))

    started, out = run_lifecycle(cfg, run_id, make_driver, resume=resume, max_restarts=None,
                                 resume_hint=IN_PROCESS_RESUME_HINT, on_iteration=report,
                                 stop_when=stop_when)
    driver = out.driver
    assert driver.svc is not None
    return {"run_id": run_id, "store": driver.store.url, "curve": out.curve,
            "uploads": out.done["uploads"], "resumed_from": started.resume_step,
            "wall_s": out.wall_s, "trainer": driver.svc.trainer,
            "engines": driver.svc.engines, "rollout": out.done["rollout"]}
