"""Prefect tasks: one thin wrapper per iteration stage (logic lives in rollart.stages), and the
runner through which the iteration driver submits them.

Tasks are coarse on purpose: a Prefect task through DaskTaskRunner costs ~0.2-0.3 s, so the
per-turn traffic stays inside the rollout service (raw Dask actor calls between its threads,
the engines and the env hosts) and Prefect sees stages.
Routing to hardware classes is `dask.annotate(resources=...)` at submission (task tags do not
route): `PrefectStages` annotates each stage with the class `cluster.stages` maps its role to.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dask
from prefect import task
from prefect.cache_policies import NONE

from rollart import stages
from rollart.config import RunConfig
from rollart.driver import STAGE_ROLE
from rollart.handles import detach
from rollart.spans import info_of

_opts = {"cache_policy": NONE, "persist_result": False}
# Task name and options per stage (every stage the driver knows); both task runners build their
# tasks from this one table.
_TASKS: dict[str, dict[str, Any]] = {s: {"name": s} for s in STAGE_ROLE} | {
    "checkpoint": {"name": "checkpoint", "retries": 2, "retry_delay_seconds": 2},
    "load_checkpoint_weights": {"name": "load_checkpoint"},
}
# `cluster.task_runner: dask`: the stage body itself is the task (shipped to its worker).
_shipped = {s: task(**o, **_opts)(getattr(stages, s)) for s, o in _TASKS.items()}
_BULKY = frozenset({"collect", "score"})  # stages whose value carries the trajectories


@dataclass
class StageOutput:
    """What a threaded stage task returns to Prefect: the Dask future of the stage's value (it
    stays on the worker that computed it and goes worker to worker to the next stage) and its
    small info dict. Prefect never sees the trajectories: it walks every task's inputs and
    outputs, and walking ~100k token ids per stage cost more than the stage itself."""

    future: Any
    info: dict[str, Any]


def on_class_worker(stage: str, resource: str, args: tuple[Any, ...],
                    call_timeout_s: float | None = None) -> StageOutput:
    """`cluster.task_runner: threads`: this task runs on a thread of the flow process; the stage
    itself runs as a raw Dask task on a worker carrying `resource` (its hardware class), with
    the run's actor-call deadline `call_timeout_s`."""
    from distributed import get_client

    client = get_client()
    inputs = [a for a in args if isinstance(a, StageOutput)]
    if any(a.future is None for a in inputs):
        raise ValueError(f"stage {stage!r} got the value of a stage that was already taken "
                         "(and released) by another stage")
    # Actors go as references: a stage must not depend on the actors' tasks (a lost engine
    # replica would cancel the sync that skips it); futures of earlier stages stay futures.
    args = tuple(a.future if isinstance(a, StageOutput) else detach(a) for a in args)
    fut = client.submit(stages.run_stage, stage, *args, resources={resource: 1}, pure=False,
                        key=f"{stage}-{uuid.uuid4()}", call_timeout_s=call_timeout_s)
    try:
        if stage in _BULKY:  # only the info dict comes back to the flow (a tiny task next to it)
            info = client.submit(info_of, fut, resources={resource: 1}, pure=False).result()
            return StageOutput(fut, info or {})
        # The value is its info dict: one round trip, and nothing left on the worker.
        info = info_of(fut.result())
        release_output(StageOutput(fut, {}))
        return StageOutput(None, info or {})
    except BaseException:  # the run is failing: nobody will take this value
        release_output(StageOutput(fut, {}))
        raise
    finally:
        # A stage's value lives until the stage that takes it has ended, then goes: a finished
        # stage whose value sits on a worker that dies later is never run again by Dask (an
        # update applied twice; a re-run stage queued on the restarted worker's only thread).
        for a in inputs:
            release_output(a)


def release_output(out: StageOutput) -> None:
    """Let Dask forget a stage's value (best effort: its client may be closing)."""
    fut, out.future = out.future, None
    if fut is not None:
        try:
            fut.release()
        except Exception:
            pass


# `cluster.task_runner: threads`: the same task names and options around `on_class_worker`.
_threaded = {s: task(**o, **_opts)(on_class_worker) for s, o in _TASKS.items()}


class PrefectStages:
    """The driver's `StageRunner` for a flow: each stage a Prefect task, run on a worker of its
    hardware class (`cluster.stages`), either shipped there by the DaskTaskRunner or submitted
    there as a raw Dask task from a thread of the flow (`cluster.task_runner`)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.roles = cfg.cluster.stages
        self.threads = cfg.cluster.task_runner == "threads"
        self.call_timeout_s = cfg.cluster.call_timeout_s

    def submit(self, stage: str, *args: Any, after: Sequence[Any] = ()) -> Any:
        resource = self.roles[STAGE_ROLE[stage]]
        if self.threads:
            return _threaded[stage].submit(stage, resource, args, self.call_timeout_s,
                                           wait_for=list(after))
        with dask.annotate(resources={resource: 1}):
            return _shipped[stage].submit(*args, wait_for=list(after))

    def info(self, pending: Any) -> dict[str, Any]:
        out = pending.result()
        return out.info if isinstance(out, StageOutput) else info_of(out) or {}


def task_runner(cfg: RunConfig, address: str) -> Any:
    """The Prefect task runner `cluster.task_runner` asks for."""
    if cfg.cluster.task_runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=8)
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=address)
