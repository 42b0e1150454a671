"""Prefect tasks: one thin wrapper per iteration stage (logic lives in rollart.stages), and the
runner through which the iteration driver submits them.

Tasks are coarse on purpose: a Prefect task through DaskTaskRunner costs ~0.2-0.3 s, so the
per-turn traffic stays inside the rollout service (raw Dask actor calls between its threads,
the engines and the env hosts) and Prefect sees stages.
Routing to hardware classes is `dask.annotate(resources=...)` at submission (task tags do not
route): `PrefectStages` annotates each stage with the class `cluster.stages` maps its role to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
from prefect import task
from prefect.cache_policies import NONE

from rollart import stages
from rollart.config import RunConfig
from rollart.driver import STAGE_ROLE

_opts = {"cache_policy": NONE, "persist_result": False}

prepare = task(name="prepare", **_opts)(stages.prepare)
collect = task(name="collect", **_opts)(stages.collect)
score = task(name="score", **_opts)(stages.score)
update = task(name="update", **_opts)(stages.update)
sync_weights = task(name="sync_weights", **_opts)(stages.sync_weights)
checkpoint = task(name="checkpoint", retries=2, retry_delay_seconds=2, **_opts)(stages.checkpoint)
evaluate = task(name="evaluate", **_opts)(stages.evaluate)
load_checkpoint_weights = task(name="load_checkpoint", **_opts)(stages.load_checkpoint_weights)


class PrefectStages:
    """The driver's `StageRunner` for a flow: stage -> Prefect task on its hardware class."""

    def __init__(self, cfg: RunConfig) -> None:
        self.roles = cfg.cluster.stages

    def submit(self, stage: str, *args: Any, after: Sequence[Any] = ()) -> Any:
        with dask.annotate(resources={self.roles[STAGE_ROLE[stage]]: 1}):
            return globals()[stage].submit(*args, wait_for=list(after))
