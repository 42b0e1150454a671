"""Prefect tasks: one thin wrapper per iteration stage (logic lives in rollart.runner.stages), and
the runner through which the iteration driver submits them.

Tasks are coarse on purpose: a Prefect task through DaskTaskRunner costs ~0.2-0.3 s, so the
per-turn traffic stays inside the rollout service (raw Dask actor calls between its threads,
the engines and the env hosts) and Prefect sees stages.
Routing to hardware classes: `dask.annotate(resources=...)` around a DaskTaskRunner submission,
or `resources=` on a raw Dask submission (task tags do not route); `PrefectStages` picks the
class `cluster.stages` maps the stage's role to.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import dask
from prefect import task
from prefect.cache_policies import NONE

from rollart.config import RunConfig
from rollart.handles import detach
from rollart.runner import stages
from rollart.runner.driver import STAGE_ROLE
from rollart.runner.spans import info_of

_opts = {"cache_policy": NONE, "persist_result": False}
# Task name and options per stage (every stage the driver knows); both task runners build their
# tasks from this one table.
_TASKS: dict[str, dict[str, Any]] = {s: {"name": s} for s in STAGE_ROLE} | {
    "checkpoint": {"name": "checkpoint", "retries": 2, "retry_delay_seconds": 2},
    "load_checkpoint_weights": {"name": "load_checkpoint"},
}
# `cluster.task_runner: dask`: the stage itself is the task (shipped to its worker), through
# `run_stage` so that it runs under the run's call deadline also on a worker that joined
# mid-run (no service there has set the deadline; the default one is 600 s).
_shipped = {s: task(**o, **_opts)(stages.run_stage) for s, o in _TASKS.items()}
_BULKY = frozenset({"collect", "score"})  # stages whose value carries the trajectories


def on_class_worker(stage: str, resource: str, args: tuple[Any, ...],
                    call_timeout_s: float | None = None) -> dict[str, Any]:
    """A stage Prefect retries (`cluster.task_runner: threads`): this task runs on a thread of
    the flow process and submits the stage as a raw Dask task on a worker carrying `resource`
    (its hardware class), with the run's actor-call deadline `call_timeout_s`; each retry
    submits anew. Returns the stage's info dict (its whole value: nothing stays on the worker)."""
    from distributed import get_client

    # Actors go as references: a stage must not depend on the actors' tasks (a lost engine
    # replica would cancel the sync that skips it).
    fut = get_client().submit(stages.run_stage, stage, *detach(args), resources={resource: 1},
                              pure=False, key=f"{stage}-{uuid.uuid4()}",
                              call_timeout_s=call_timeout_s)
    try:
        return info_of(fut.result()) or {}
    finally:
        fut.release()


# Retried stages under `cluster.task_runner: threads`: the same task names and options.
_threaded = {s: task(**o, **_opts)(on_class_worker) for s, o in _TASKS.items()}


class Flight:
    """A stage the threaded runner has submitted to Dask: the future of its value, the future
    of its info dict (bulky stages: computed next to the value, so the trajectories never
    travel to the flow), and the Prefect task run that tracks it. A plain class on purpose:
    Prefect walks dataclasses and lists among a task's parameters and would wait on the
    futures it finds there."""

    __slots__ = ("stage", "future", "info_future", "tracker")

    def __init__(self, stage: str, future: Any, info_future: Any) -> None:
        self.stage, self.future, self.info_future = stage, future, info_future
        self.tracker: Any = None

    def info(self) -> dict[str, Any]:
        if self.info_future is not None:
            return self.info_future.result() or {}
        return info_of(self.future.result()) or {}

    def release(self) -> None:
        """The flow's references go; Dask keeps the value while a submitted stage needs it."""
        for fut in (self.future, self.info_future):
            if fut is not None:
                try:
                    fut.release()
                except Exception:  # its client may be closing
                    pass
        self.future = self.info_future = None


def track_stage(stage: str, flight: Flight) -> dict[str, Any]:
    """The Prefect task run of a stage that already runs on Dask: it starts when the stages it
    waits for have ended (its `wait_for`), ends with the stage, fails with it, and returns the
    stage's info dict (metrics, where it ran, its span)."""
    return flight.info()


_tracked = {s: task(**{**o, "retries": 0}, **_opts)(track_stage) for s, o in _TASKS.items()}


class PrefectStages:
    """The driver's `StageRunner` for a flow: each stage a Prefect task, run on a worker of its
    hardware class (`cluster.stages`), either shipped there by the DaskTaskRunner or, with
    `cluster.task_runner: threads` (the default), submitted as a raw Dask task.

    Threads: `submit` hands the stage to the Dask scheduler at once, with the Dask futures of
    the stages it takes values from or waits for (`after`) as its dependencies, so an
    iteration's chain (collect -> score -> update -> sync -> evaluate) runs worker to worker
    without a round trip to the flow between stages; a Prefect task per stage, started on a
    thread of the flow with `wait_for` its upstream tasks, tracks the stage's state and
    returns its info dict. Stages that Prefect retries (`checkpoint`) are submitted by their
    own task run instead (each retry submits anew). A stage's value is released when the
    driver has read its info, i.e. after every stage of the iteration was submitted: Dask
    keeps it while a stage that takes it runs, then forgets it (a value held longer would be
    recomputed by Dask if its worker died: an update applied twice)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.roles = cfg.cluster.stages
        self.threads = cfg.cluster.task_runner == "threads"
        self.call_timeout_s = cfg.cluster.call_timeout_s
        self.flights: list[Flight] = []  # submitted, info not yet read

    def submit(self, stage: str, *args: Any, after: Sequence[Any] = ()) -> Any:
        resource = self.roles[STAGE_ROLE[stage]]
        if not self.threads:
            with dask.annotate(resources={resource: 1}):
                return _shipped[stage].submit(stage, *args, call_timeout_s=self.call_timeout_s,
                                              wait_for=list(after))
        upstream = [a for a in (*args, *after) if isinstance(a, Flight)]
        wait_for = [f.tracker for f in upstream]
        others = [a for a in after if not isinstance(a, Flight)]  # Prefect futures
        if _TASKS[stage].get("retries"):
            if any(isinstance(a, Flight) for a in args):
                raise ValueError(f"stage {stage!r} is retried by Prefect: it cannot take "
                                 "another stage's value")
            return _threaded[stage].submit(stage, resource, args, self.call_timeout_s,
                                           wait_for=wait_for + others)
        for other in others:  # a retried stage: Dask cannot wait for it, so the flow does
            other.wait()
        from distributed import default_client

        client = default_client()
        # Actors go as references (see on_class_worker); earlier stages' values as futures.
        dask_args = tuple(a.future if isinstance(a, Flight) else detach(a) for a in args)
        if any(f.future is None for f in upstream):
            raise ValueError(f"stage {stage!r} got the value of a stage that was already taken "
                             "(and released)")
        fut = client.submit(stages.run_stage, stage, *dask_args, resources={resource: 1},
                            pure=False, key=f"{stage}-{uuid.uuid4()}",
                            call_timeout_s=self.call_timeout_s,
                            after=[f.future for f in upstream if f in after] or None)
        info = client.submit(info_of, fut, resources={resource: 1}, pure=False,
                             key=f"{stage}-info-{uuid.uuid4()}") if stage in _BULKY else None
        flight = Flight(stage, fut, info)
        flight.tracker = _tracked[stage].submit(stage, flight, wait_for=wait_for)
        self.flights.append(flight)
        return flight

    def info(self, pending: Any) -> dict[str, Any]:
        try:
            out = pending.tracker.result() if isinstance(pending, Flight) else pending.result()
        except BaseException:  # the run is failing: nobody will take the values in flight
            for f in self.flights:
                f.release()
            self.flights.clear()
            raise
        if isinstance(pending, Flight):
            pending.release()
            self.flights = [f for f in self.flights if f is not pending]
            return out
        return info_of(out) or {}


def task_runner(cfg: RunConfig, address: str) -> Any:
    """The Prefect task runner `cluster.task_runner` asks for."""
    if cfg.cluster.task_runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=8)
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=address)
