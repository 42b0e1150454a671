"""One run's lifecycle, the same for both modes: the Prefect flow (`flows/train.py`) and the
in-process mode (`rollart/runner/local_loop.py`).

1. Lock: the run's writer lock (`rollart/storage/lock.py`), taken before any file of the run is
   touched (a resume's rollback included) and held until the run ends or aborts.
2. Start checks (`rollart/storage/resume.py` `start_run`): the store is usable (one-line
   StorageError); a run id that already has checkpoints is refused unless resuming; a resume
   may not change a plan-defining key (`PLAN_KEYS`) and rolls the store back to the latest
   intact checkpoint (ResumeError).
3. Drive: the iteration driver from `start` through `iterations` to `finish` (final checkpoint
   and every upload durable). Where the mode can restart (the flow: services are actors on
   workers that may be lost), a lost service makes the run resume from its latest checkpoint on
   new services (`rollart/runner/recovery.py` `run_with_restarts`); where it cannot (in-process), a
   failure aborts the driver and propagates.
4. Release the lock, at the end or on abort alike.

Two calls, because the flow holds the lock in its parent flow (around the cluster it starts)
and drives the run in its `iterations` subflow (inside a Dask client): `started_run` (steps 1,
2, 4: a context manager) and `drive_run` (step 3). `run_lifecycle` chains them for a mode that
runs in one call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rollart.config import RunConfig
from rollart.run import RunSpec
from rollart.runner.driver import IterationDriver, IterationResult
from rollart.runner.recovery import run_with_restarts
from rollart.storage.lock import RunLock, run_lock
from rollart.storage.resume import FLOW_RESUME_HINT, ResumePoint, start_run

MakeDriver = Callable[[RunSpec, int], IterationDriver]  # (run, attempt) -> a driver


@dataclass
class StartedRun:
    """A run past its start checks, its lock held."""

    cfg: RunConfig  # on resume: the config the resumed run uses (`start_run`)
    run_id: str
    point: ResumePoint | None  # where a resume continues from; None for a new run
    lock: RunLock

    @property
    def resume_step(self) -> int | None:
        return self.point.step if self.point is not None else None


@dataclass
class DrivenRun:
    """A run driven to its end: the driver (its services), every iteration's metrics, what
    `finish` returned, the restarts it took and its wall time."""

    driver: IterationDriver
    curve: list[dict[str, Any]]
    done: dict[str, Any]
    restarts: list[dict[str, Any]]
    wall_s: float


@contextlib.contextmanager
def started_run(cfg: RunConfig, run_id: str, *, resume: bool,
                overrides: list[str] | None = None,
                resume_hint: str = FLOW_RESUME_HINT) -> Iterator[StartedRun]:
    """Lock the run and pass its start checks (steps 1 and 2 of the module docstring); the
    lock is released when the block ends, however it ends, or at once when a check fails
    (StorageError, RunLockedError or ResumeError propagate). `overrides`: re-applied on the
    stored config on resume (the flow); None: `cfg` is the run's whole config (in-process)."""
    lock = run_lock(cfg.storage, run_id)
    try:
        cfg, point = start_run(cfg, overrides, run_id, resume, lock=lock,
                               resume_hint=resume_hint)
    except BaseException:
        lock.release()  # idempotent: also when the check that failed was the lock itself
        raise
    try:
        yield StartedRun(cfg, run_id, point, lock)
    finally:
        lock.release()


def drive_run(run: RunSpec, make_driver: MakeDriver, resume_step: int | None, *,
              max_restarts: int | None,
              on_iteration: Callable[[IterationResult], None] | None = None,
              on_restart: Callable[[dict[str, Any]], None] | None = None,
              stop_when: Callable[[list[float]], bool] | None = None) -> DrivenRun:
    """Step 3: the driver `make_driver(run, attempt)` builds, from `resume_step` (None: a new
    run) to `finish`; `max_restarts` restarts at most from the latest checkpoint when a
    service is lost, None where the mode cannot restart. A lost service is probed for as long
    as a call may take (`cluster.call_timeout_s`)."""
    t0 = time.perf_counter()
    driver, curve, done, restarts = run_with_restarts(
        lambda attempt: make_driver(run, attempt), run.store(), max_restarts, resume_step,
        on_iteration, on_restart, probe_timeout_s=run.cfg.cluster.call_timeout_s,
        stop_when=stop_when)
    return DrivenRun(driver, curve, done, restarts, time.perf_counter() - t0)


def run_lifecycle(cfg: RunConfig, run_id: str, make_driver: MakeDriver, *, resume: bool,
                  max_restarts: int | None, overrides: list[str] | None = None,
                  resume_hint: str = FLOW_RESUME_HINT,
                  on_start: Callable[[StartedRun], None] | None = None,
                  on_iteration: Callable[[IterationResult], None] | None = None,
                  on_restart: Callable[[dict[str, Any]], None] | None = None,
                  stop_when: Callable[[list[float]], bool] | None = None,
                  ) -> tuple[StartedRun, DrivenRun]:
    """The whole lifecycle in one call (module docstring): `on_start(started)` after the start
    checks, before any service exists; the lock is released when this returns or raises."""
    with started_run(cfg, run_id, resume=resume, overrides=overrides,
                     resume_hint=resume_hint) as started:
        if on_start is not None:
            on_start(started)
        run = RunSpec(started.cfg, run_id)
        return started, drive_run(run, make_driver, started.resume_step,
                                  max_restarts=max_restarts, on_iteration=on_iteration,
                                  on_restart=on_restart, stop_when=stop_when)
