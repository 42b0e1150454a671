"""Prefect tasks: one thin wrapper per iteration stage (logic lives in rollart.stages).

Tasks are coarse on purpose: a Prefect task through DaskTaskRunner costs ~0.2-0.3 s, so the
per-turn traffic stays inside the rollout service (raw Dask actor calls between its threads,
the engines and the env hosts) and Prefect sees stages.
Routing to hardware classes is done by the caller with `dask.annotate(resources=...)`.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from rollart import stages

_opts = {"cache_policy": NONE, "persist_result": False}

prepare = task(name="prepare", **_opts)(stages.prepare)
collect = task(name="collect", **_opts)(stages.collect)
score = task(name="score", **_opts)(stages.score)
update = task(name="update", **_opts)(stages.update)
sync_weights = task(name="sync_weights", **_opts)(stages.sync_weights)
checkpoint = task(name="checkpoint", retries=2, retry_delay_seconds=2, **_opts)(stages.checkpoint)
evaluate = task(name="evaluate", **_opts)(stages.evaluate)
