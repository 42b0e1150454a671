"""The same iteration as the Prefect flow, in one process, with services held as plain objects.

Used by benchmarks and unit tests to exercise the RL loop without a cluster or a Prefect server
(the flow is the orchestrated version of exactly these calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollart import stages
from rollart.config import RunConfig
from rollart.metrics import summary_row
from rollart.rollout.env_host import EnvHost
from rollart.services import EngineService, TrainerService
from rollart.storage.background import flush_all
from rollart.storage.resume import prepare_resume
from rollart.storage.store import RunStore


def run_local(cfg: RunConfig, run_id: str, on_iteration: Callable[[dict], None] | None = None,
              eval_every: int | None = None,
              stop_when: Callable[[list[float]], bool] | None = None,
              resume: bool = False) -> dict[str, Any]:
    """Run `cfg.iterations` iterations; `stop_when(eval_history)` may end the run early.
    `resume`: continue run `run_id` from its latest complete checkpoint (exact resume)."""
    cfg_dict = cfg.model_dump(mode="json")
    root = cfg.storage.root
    store = RunStore.from_config(cfg.storage, run_id)
    point = prepare_resume(store) if resume else None
    stages.prepare(cfg_dict, root, run_id)
    trainer = TrainerService(cfg_dict, root, run_id)
    replicas = len(cfg.cluster.engine_classes(cfg.engine.replicas))
    engines = [EngineService(cfg_dict, root, run_id, r) for r in range(replicas)]
    if point is not None:
        stages.restore(trainer, engines, point.step)
    synced = stages.sync_weights(trainer, engines)
    # Env host in this process; the service's threads keep episodes flowing during updates.
    rollout = stages.rollout_service(cfg, root, run_id, engines, [EnvHost(cfg.tasks)],
                                     version=point.next_iteration if point else 0)
    rollout.start()
    curve: list[dict[str, Any]] = []
    evals: list[float] = []
    every = cfg.eval.every if eval_every is None else eval_every
    t_start = time.perf_counter()
    for it in range(point.next_iteration if point else 0, cfg.iterations):
        t0 = time.perf_counter()
        collected = stages.collect(rollout, it)
        scored = stages.score(cfg_dict, root, run_id, it, collected)
        updated = stages.update(trainer, scored)
        step = it + 1
        checkpoint_due = step % cfg.storage.save_every == 0 or step == cfg.iterations
        # On a checkpoint iteration the next batch starts only after the snapshot, so the
        # engines' sampling RNG is captured at rest (exact resume with max_staleness 0).
        synced = stages.sync_weights(trainer, engines, None if checkpoint_due else rollout, step)
        m: dict[str, Any] = {"iteration": float(it)}
        for part in (collected[1], scored[1], updated, synced):
            m.update(part["metrics"])
        if cfg.eval.episodes and ((every and step % every == 0) or step == cfg.iterations):
            m.update(stages.evaluate(cfg_dict, root, run_id, engines, cfg.eval.episodes)["metrics"])
        if checkpoint_due:
            stages.checkpoint(trainer, step, {"iteration": it}, engines)
            rollout.set_version(step)
        m["perf/iteration_s"] = time.perf_counter() - t0
        m["perf/elapsed_s"] = time.perf_counter() - t_start
        store.append_jsonl("metrics.jsonl", m)
        curve.append(m)
        if on_iteration:
            on_iteration(summary_row(m))
        if "eval/success_rate" in m:
            evals.append(m["eval/success_rate"])
            if stop_when is not None and stop_when(evals):
                break
    rollout_stats = rollout.stop()
    uploads = trainer.flush_checkpoints()  # the final checkpoint is durable before returning
    flush_all()
    return {"run_id": run_id, "store": store.url, "curve": curve, "uploads": uploads,
            "resumed_from": point.step if point else None,
            "wall_s": time.perf_counter() - t_start, "trainer": trainer, "engines": engines,
            "rollout": rollout_stats}
