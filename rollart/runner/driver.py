"""The one iteration driver: what runs each step, in which order, and which metrics merge.

Both ways of running consume it, so tests and benchmarks exercise the loop that users run:
- the Prefect flow (`flows/train.py`): stages are Prefect tasks on hardware-class Dask workers,
  services are Dask actors;
- the in-process mode (`rollart/runner/local_loop.py`): stages are plain calls, services plain
  objects.
They differ only in a `StageRunner` (where a stage runs) and a `ServiceFactory` (where the
long-lived services live).

    start:  prepare -> trainer and engines (building at once on a cluster), env hosts
            -> [restore checkpoint] -> sync weights
            -> rollout service (keeps episodes running across iterations)
    iteration it (step = it + 1, the policy version the update produces):
            collect(it) -> score -> update -> sync_weights(step)
            [checkpoint(step)]  every storage.save_every steps and at the last one
            [evaluate]          every eval.every steps and at the last one, after the sync
    finish: stop the rollout service, wait for checkpoint uploads and shards
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollart.config import RunConfig
from rollart.handles import call, release, set_call_timeout
from rollart.run import RunSpec
from rollart.runner import stages
from rollart.runner.metric_sinks import make_sinks
from rollart.runner.recovery import EngineSupervisor, rebuild_rollout
from rollart.runner.spans import SPAN, busy_seconds, info_of
from rollart.service_protocols import (
    BuildsAhead,
    EngineAPI,
    ReplacesEngines,
    RolloutAPI,
    TrainerAPI,
)
from rollart.storage.run_files import sign_run_files

# The hardware-class role (a key of `cluster.stages`) each stage runs on.
STAGE_ROLE: dict[str, str] = {
    "prepare": "env",
    "collect": "env",
    "score": "reward",
    "update": "trainer",
    "sync_weights": "engine",
    "checkpoint": "trainer",
    "evaluate": "env",
    "load_checkpoint_weights": "engine",
}


class Pending(Protocol):
    """A submitted stage; `result()` waits for it (a Prefect future, or `Done`)."""

    def result(self) -> Any: ...


class StageRunner(Protocol):
    """Runs stage `stage` (a function of `rollart.runner.stages`) with `args`, after `after`. A
    submitted stage's handle may be passed as an argument of a later stage (its value then
    reaches that stage where it runs); `info` waits for a stage and returns only its info
    dict (metrics, where it ran, its span), which is all the driver needs from it."""

    def submit(self, stage: str, *args: Any, after: Sequence[Pending] = ()) -> Pending: ...

    def info(self, pending: Pending) -> dict[str, Any]: ...


class ServiceFactory(Protocol):
    """Creates the run's long-lived services where they belong."""

    def trainer(self) -> TrainerAPI: ...
    def engines(self) -> Sequence[EngineAPI]: ...
    def env_hosts(self) -> list[Any]: ...
    def rollout(self, engines: list[EngineAPI], hosts: list[Any], version: int) -> RolloutAPI: ...
    def host_stats(self, hosts: list[Any]) -> list[dict[str, Any] | None]: ...
    def flush_shards(self) -> int: ...


@dataclass
class Done:
    """An already computed stage result (the in-process runner)."""

    value: Any

    def result(self) -> Any:
        return self.value


class InProcessRunner:
    """Stages as plain calls, in submission order (the in-process mode)."""

    def submit(self, stage: str, *args: Any, after: Sequence[Pending] = ()) -> Done:
        fn = getattr(stages, stage)
        return Done(fn(*[a.result() if isinstance(a, Done) else a for a in args]))

    def info(self, pending: Pending) -> dict[str, Any]:
        return info_of(pending.result()) or {}


@dataclass(frozen=True)
class StepPlan:
    """What iteration `iteration` does beyond collect -> score -> update -> sync."""

    iteration: int
    step: int  # iteration + 1: the update's number and the policy version it produces
    checkpoint: bool
    evaluate: bool


def plan_step(cfg: RunConfig, iteration: int, eval_every: int | None = None) -> StepPlan:
    step = iteration + 1
    last = step == cfg.iterations
    every = cfg.eval.every if eval_every is None else eval_every
    return StepPlan(
        iteration=iteration,
        step=step,
        checkpoint=step % cfg.storage.save_every == 0 or last,
        evaluate=bool(cfg.eval.episodes) and (bool(every and step % every == 0) or last),
    )


def eval_stop(stop_at: float | None,
              stop_after: int) -> Callable[[list[float]], bool] | None:
    """`stop_when` for `eval.stop_at`: the last `stop_after` greedy evaluations all >= it."""
    if stop_at is None:
        return None
    return lambda evals: len(evals) >= stop_after and min(evals[-stop_after:]) >= stop_at


def control_plane_metrics(infos: dict[str, dict[str, Any]], start: float,
                          end: float) -> dict[str, float]:
    """Split the iteration [start, end] into stage work (each stage's own span, measured where
    it ran; concurrent stages count once) and orchestration (everything else: task submission
    and state tracking, scheduling, actor round trips, serialisation)."""
    spans = {k: i[SPAN] for k, i in infos.items() if i.get(SPAN)}
    m = {f"perf/stage/{k}_s": b - a for k, (a, b) in spans.items()}
    busy = busy_seconds(spans.values(), start, end)
    wall = max(end - start, 1e-9)
    m["perf/stage_busy_s"] = busy
    m["perf/orchestration_s"] = wall - busy
    m["perf/orchestration_share"] = (wall - busy) / wall
    return m


@dataclass
class Services:
    trainer: TrainerAPI
    engines: list[EngineAPI]
    hosts: list[Any]
    rollout: RolloutAPI


@dataclass
class IterationResult:
    plan: StepPlan
    metrics: dict[str, Any]
    checkpoint: dict[str, Any] | None  # what the checkpoint stage returned, on checkpoint steps


@dataclass
class Placement:
    """Where each stage and service ran (worker name and resources), for the run's record."""

    by_stage: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __call__(self, stage: str, info: dict[str, Any]) -> dict[str, Any]:
        self.by_stage.setdefault(stage, []).append(
            {k: info.get(k) for k in ("worker", "resources", "ranks") if k in info or
             k != "ranks"})
        return info


class IterationDriver:
    """Runs one training run through `runner` on the services `factory` makes."""

    def __init__(self, run: RunSpec, runner: StageRunner, factory: ServiceFactory,
                 placement: Placement | None = None, eval_every: int | None = None) -> None:
        self.run, self.cfg = run, run.cfg
        set_call_timeout(run.cfg.cluster.call_timeout_s)  # this process's actor calls
        self.runner, self.factory = runner, factory
        self.placed = placement or Placement()
        self.eval_every = eval_every
        self.store = run.store()
        self.sinks = make_sinks(run.cfg, run.run_id)
        self.svc: Services | None = None
        self.restored: dict[str, Any] | None = None
        self.supervisor: EngineSupervisor | None = None
        self.rollout_rebuilds: list[dict[str, Any]] = []  # rollout services rebuilt live
        self.t_start = time.perf_counter()

    # ---- start ---------------------------------------------------------------------------
    def start(self, resume_step: int | None = None) -> int:
        """Create the services (restored from checkpoint `resume_step`); returns the first
        iteration to run."""
        info, f = self.runner.info, self.factory
        # The engines build while the trainer does (BuildsAhead). A model of an HF directory
        # brings its tokenizer: its engines start before prepare, whose imports on a CPU worker
        # otherwise run with the other workers idle. The run's own tokenizer (model.source
        # tiny) is what prepare writes: its engines wait for it.
        early = self.cfg.model.source == "hf_dir"
        if early and isinstance(f, BuildsAhead):
            f.begin()
        self.placed("prepare", info(self.runner.submit("prepare", self.run)))
        sign_run_files(self.store)  # config + tokenizer, here where the owner's key is
        if not early and isinstance(f, BuildsAhead):
            f.begin()
        trainer, engines, hosts = f.trainer(), list(f.engines()), f.env_hosts()
        first = 0
        if resume_step is not None:  # trainer state, ledger, engine RNG; weights synced below
            self.restored = stages.restore(trainer, engines, resume_step)
            first = int(self.restored["next_iteration"])
        self.placed("sync_weights", info(self.runner.submit("sync_weights", trainer, engines)))
        if resume_step is None and self.cfg.eval.before_training and self.cfg.eval.episodes:
            self._evaluate_initial(engines)
        rollout = f.rollout(engines, hosts, first)
        if self.restored is not None:  # async runs: the groups it held at the checkpoint
            state, pending = call(trainer).take_rollout_state()
            if state is not None:
                self.restored["rollout"] = call(rollout).restore_state(state, pending)
        self.placed("rollout_service", call(rollout).start() or {})
        self.svc = Services(trainer, engines, hosts, rollout)
        if isinstance(f, ReplacesEngines):  # replicas on workers that can be lost: bring them back
            self.supervisor = EngineSupervisor(engines, trainer, rollout, f, stages.push_weights)
            self.supervisor.start()
        self.t_start = time.perf_counter()
        return first

    def _evaluate_initial(self, engines: list[EngineAPI]) -> None:
        """`eval.before_training`: the initial policy's greedy evaluation, before any episode
        of the run starts, as the metrics row of iteration -1 (version 0)."""
        got = self.placed("evaluate", self.runner.info(self.runner.submit(
            "evaluate", self.run, engines, self.cfg.eval.episodes)))
        m = {"iteration": -1.0, "version": 0.0, **got["metrics"]}
        self.store.append_jsonl("metrics.jsonl", m)
        for sink in self.sinks:
            sink.write(0, m)

    # ---- one iteration -------------------------------------------------------------------
    def iteration(self, it: int) -> IterationResult:
        """Iteration `it`; a rollout service that broke while its worker lives is rebuilt
        from its live state and the iteration run again (its collect failed: nothing after
        it ran), once; anything else goes to the caller (run_with_restarts)."""
        try:
            return self._iteration(it)
        except Exception as err:
            event = rebuild_rollout(self, err, it, min(self.cfg.cluster.call_timeout_s, 30.0))
            if event is None:
                raise
            self.rollout_rebuilds.append(event)
            return self._iteration(it)

    def _iteration(self, it: int) -> IterationResult:
        assert self.svc is not None, "start() first"
        sv, run, submit, placed = self.svc, self.run, self.runner.submit, self.placed
        plan = plan_step(self.cfg, it, self.eval_every)
        serving, slots = self.serving(), self.slots()  # lost replicas are skipped
        t0, wall0 = time.perf_counter(), time.time()
        collected = submit("collect", sv.rollout, it)
        scored = submit("score", run, it, collected)
        updated = submit("update", sv.trainer, scored, plan.step)
        # On a checkpoint step the rollout service hears of the new version only after the
        # snapshot, so the engines' sampling RNG is captured at rest (exact resume, alpha = 0).
        synced = submit("sync_weights", sv.trainer, serving,
                        None if plan.checkpoint else sv.rollout, plan.step, after=[updated])
        ckpt = submit("checkpoint", sv.trainer, plan.step, {"iteration": it}, slots,
                      sv.rollout, after=[updated]) if plan.checkpoint else None
        ev = submit("evaluate", run, serving, self.cfg.eval.episodes,
                    after=[synced]) if plan.evaluate else None

        m: dict[str, Any] = {"iteration": float(it), "version": float(plan.step)}
        info = self.runner.info
        infos = {"collect": info(collected), "score": info(scored), "update": info(updated),
                 "sync_weights": info(synced)}
        for stage, got in infos.items():
            m.update(placed(stage, got)["metrics"])
        saved = None
        if ckpt is not None:
            saved = infos["checkpoint"] = placed("checkpoint", info(ckpt))
            call(sv.rollout).set_version(plan.step)  # engines serve it: episodes may start
            got_ckpt = stages.CheckpointSaved.of(saved)
            m["perf/checkpoint_s"] = got_ckpt.save_s  # blocking part; the upload is below
            for upload_s in got_ckpt.upload_s:  # background uploads finished since
                m["perf/checkpoint_upload_s"] = upload_s
        if ev is not None:
            infos["evaluate"] = placed("evaluate", info(ev))
            m.update(infos["evaluate"]["metrics"])
        m.update(control_plane_metrics(infos, wall0, time.time()))
        m["perf/iteration_s"] = time.perf_counter() - t0
        m["perf/elapsed_s"] = time.perf_counter() - self.t_start
        self.store.append_jsonl("metrics.jsonl", m)
        for sink in self.sinks:
            sink.write(plan.step, m)
        return IterationResult(plan, m, saved)

    def iterations(self, first: int,
                   on_iteration: Callable[[IterationResult], None] | None = None,
                   stop_when: Callable[[list[float]], bool] | None = None
                   ) -> list[dict[str, Any]]:
        """Iterations `first` .. `cfg.iterations - 1`; `stop_when(greedy eval history)` (by
        default the config's `eval.stop_at`) may end the run early, after a checkpoint of the
        last iteration's policy. Returns every iteration's metrics."""
        stop_when = stop_when or eval_stop(self.cfg.eval.stop_at, self.cfg.eval.stop_after)
        curve: list[dict[str, Any]] = []
        evals: list[float] = []
        for it in range(first, self.cfg.iterations):
            res = self.iteration(it)
            curve.append(res.metrics)
            stop = False
            if "eval/success_rate" in res.metrics:
                evals.append(res.metrics["eval/success_rate"])
                stop = stop_when is not None and stop_when(evals)
            if stop:
                res.metrics["eval/stopped_early"] = 1.0
                if res.checkpoint is None:  # the policy the run stops with is the one saved
                    res.checkpoint = self.checkpoint(res.plan)
            if on_iteration is not None:
                on_iteration(res)
            if stop:
                break
        return curve

    def serving(self) -> list[EngineAPI]:
        """The engine replicas in rotation (all of them without a supervisor)."""
        assert self.svc is not None
        return self.supervisor.serving() if self.supervisor else list(self.svc.engines)

    def slots(self) -> list[EngineAPI | None]:
        """One entry per replica index, None for a lost one."""
        assert self.svc is not None
        return self.supervisor.slots() if self.supervisor else list(self.svc.engines)

    def checkpoint(self, plan: StepPlan) -> dict[str, Any]:
        """Checkpoint the policy of `plan.step` outside the cadence (an early stop)."""
        assert self.svc is not None, "start() first"
        sv = self.svc
        saved = self.placed("checkpoint", self.runner.info(self.runner.submit(
            "checkpoint", sv.trainer, plan.step, {"iteration": plan.iteration}, self.slots(),
            sv.rollout)))
        call(sv.rollout).set_version(plan.step)
        return saved

    # ---- finish --------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Stop the rollout service; the final checkpoint and every background upload are
        durable before this returns."""
        assert self.svc is not None, "start() first"
        sv = self.svc
        self._stop_supervisor()
        rollout_stats = call(sv.rollout).stop()
        rollout_stats["engines_revived"] = self.supervisor.events if self.supervisor else []
        rollout_stats["rebuilt"] = self.rollout_rebuilds
        rollout_stats["env_hosts"] = self.factory.host_stats(sv.hosts)
        # Waits for uploads as long as they take (each store operation has its own retry
        # budget, storage.retry_timeout_s): a large checkpoint may outlast any call deadline.
        uploads = call(sv.trainer, timeout=None).flush_checkpoints()
        shards = self.factory.flush_shards()
        self._close_sinks()
        prints = {"trainer": call(sv.trainer).fingerprint(),
                  "engine": call(self.serving()[0]).fingerprint()}
        call(sv.trainer).close()  # a sharded trainer's ranks leave their group
        return {"rollout": rollout_stats, "uploads": uploads, "shards_flushed": shards,
                "fingerprints": prints}

    def _stop_supervisor(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()

    def _close_sinks(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def release(self) -> None:
        """After `abort`, before the services are created again: let the cluster forget these."""
        if self.svc is not None:
            sv = self.svc
            for handle in [sv.trainer, sv.rollout, *sv.engines, *sv.hosts]:
                release(handle)

    def abort(self) -> None:
        """After a failure: stop the rollout service's episodes (best effort)."""
        self._close_sinks()
        self._stop_supervisor()
        if self.svc is not None and self.svc.rollout is not None:
            try:
                call(self.svc.rollout).stop()
            except Exception:  # its worker may be the thing that failed
                pass
