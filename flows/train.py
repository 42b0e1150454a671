"""Prefect flow `train`: each RL iteration is a DAG of stage tasks on hardware-class Dask workers.

    collect (env class) -> score (reward class) -> update (trainer class)
        -> sync_weights (engine class) -> [checkpoint (trainer class)] [evaluate (env class)]

The flow only orchestrates: it validates the config, starts or connects to the Dask cluster,
creates the long-lived services as Dask actors pinned to their classes (engine replicas, the
trainer, one env host per env-class worker, and the rollout service that keeps episodes running
across iterations), then submits one DAG per iteration with every submission annotated with its
class. `collect` takes the next batch of complete groups from the rollout service.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import dask
from distributed import Client
from prefect import flow, get_run_logger
from prefect.states import Failed
from prefect_dask import DaskTaskRunner

import tasks.stages as t
from blocks import resolve_blocks
from flows.artifacts import RunArtifacts
from infra.dask_cluster import HardwareClassCluster, worker_classes
from infra.lambda_endpoint import with_embedded_endpoint
from rollart import progress
from rollart import stages as stage_fns
from rollart.config import RunConfig, config_from_dict, load_config
from rollart.metrics import summary_row
from rollart.rollout.env_host import EnvHostService
from rollart.services import EngineService, RolloutServiceActor, TrainerService
from rollart.storage.background import flush_all
from rollart.storage.resume import ResumeError, describe, start_run
from rollart.storage.s3 import StorageError
from rollart.storage.store import RunStore


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="train")
def train(
    config: str = "configs/default.yaml",
    overrides: list[str] | None = None,
    scheduler_address: str | None = None,
    run_id: str | None = None,
    storage_block: str | None = None,
    rewards_block: str | None = None,
    cluster_block: str | None = None,
    model_block: str | None = None,
    resume: str | None = None,
) -> dict[str, Any]:
    """Train a policy. `scheduler_address` uses an existing Dask cluster instead of starting one.
    `*_block` name Prefect blocks (blocks/) whose settings apply between the config file and
    `overrides`; their secrets go to the environment, never into the config or the logs.
    `resume` (a run id) continues that run from its latest complete checkpoint."""
    blocks = resolve_blocks(storage_block, rewards_block, cluster_block, model_block)
    # invalid config fails before any cluster starts
    cfg = load_config(config, blocks.overrides + list(overrides or []))
    blocks.apply_environment()
    if resume and run_id and run_id != resume:
        return Failed(message=f"run_id {run_id!r} and resume {resume!r} differ")
    run_id = resume or run_id or new_run_id(cfg.name)
    logger = get_run_logger()
    try:  # store reachable with these credentials; resume point; before any cluster starts
        cfg, point = start_run(cfg, blocks.overrides + list(overrides or []), run_id,
                               resume=bool(resume))
    except (StorageError, ResumeError) as err:
        return Failed(message=str(err))
    if point is not None:
        logger.info(describe(point))
        progress.note(describe(point).capitalize())
    address = scheduler_address or cfg.cluster.address
    with contextlib.ExitStack() as stack:
        if address is None:
            cluster = stack.enter_context(HardwareClassCluster(
                workers=cfg.cluster.workers, threads_per_worker=cfg.cluster.threads_per_worker,
                dashboard=cfg.cluster.dashboard,
            ))
            address = cluster.scheduler_address
            logger.info("Embedded Dask cluster %s, dashboard %s", address, cluster.dashboard_link)
            progress.note(f"Dask dashboard:  {cluster.dashboard_link}")
        from prefect.runtime import flow_run

        progress.note(f"Prefect flow run: {flow_run.ui_url}")
        cfg = with_embedded_endpoint(cfg, stack)
        if cfg.reward.endpoint_url and cfg.reward.embedded_endpoint:
            progress.note(f"Rewards:         local Lambda endpoint {cfg.reward.endpoint_url}")
        runner = DaskTaskRunner(address=address)
        return iterations.with_options(task_runner=runner)(
            cfg.model_dump(mode="json"), run_id, address, point.step if point else None
        )


def _check_classes(client: Client, cfg: RunConfig) -> dict[str, list[str]]:
    have = worker_classes(client)
    wanted = set(cfg.cluster.stages.values()) | set(cfg.cluster.engine_classes(cfg.engine.replicas))
    missing = sorted(c for c in wanted if c not in have)
    if missing:
        raise RuntimeError(
            f"no Dask worker carries resource(s) {missing}; start workers with "
            f"`dask worker --resources {missing[0]}=1` or fix cluster.stages"
        )
    return have


def _host_stats(host: Any) -> dict[str, Any] | None:
    try:
        return host.stats().result(timeout=10)
    except Exception:  # its worker is gone
        return None


@flow(name="iterations")
def iterations(cfg_dict: dict[str, Any], run_id: str, address: str,
               resume_step: int | None = None) -> dict[str, Any]:
    cfg = config_from_dict(cfg_dict)
    logger = get_run_logger()
    root = cfg.storage.root
    store = RunStore.from_config(cfg.storage, run_id)
    stages = cfg.cluster.stages

    def on(stage: str):
        return dask.annotate(resources={stages[stage]: 1})

    placement: dict[str, list[dict[str, Any]]] = {}

    def placed(stage: str, info: dict[str, Any]) -> dict[str, Any]:
        placement.setdefault(stage, []).append(
            {k: info.get(k) for k in ("worker", "resources")})
        return info

    with Client(address) as client:
        _check_classes(client, cfg)
        with on("env"):
            placed("prepare", t.prepare.submit(cfg_dict, root, run_id).result())
        trainer = client.submit(TrainerService, cfg_dict, root, run_id, actor=True,
                                resources={stages["trainer"]: 1}).result()
        # One engine replica per entry of cluster.engine_pools (default: engine.replicas on the
        # `engine` stage's class), each pinned to its hardware class.
        engine_classes = cfg.cluster.engine_classes(cfg.engine.replicas)
        engines = [
            client.submit(EngineService, cfg_dict, root, run_id, r, actor=True,
                          resources={hw: 1}, key=f"engine-{run_id}-{r}").result()
            for r, hw in enumerate(engine_classes)
        ]
        placed("trainer_service", trainer.where().result())
        for e in engines:
            placed("engine_service", e.where().result())
        # One env host per env-class worker: episodes survive the loss of any one of them.
        env_workers = _check_classes(client, cfg)[stages["env"]]
        hosts = [client.submit(EnvHostService, cfg_dict, actor=True, workers=[addr],
                               key=f"env-host-{run_id}-{i}").result()
                 for i, addr in enumerate(env_workers)]
        # The rollout service reaches hosts by (key, address), not as task dependencies: a lost
        # env worker must not take the service's own actor down with it.
        host_refs = [(h.key, placed("env_host", h.stats().result())["address"]) for h in hosts]
        start = 0
        if resume_step is not None:  # trainer state, ledger, engine RNG; weights synced below
            restored = stage_fns.restore(trainer, engines, resume_step)
            start = restored["next_iteration"]
            logger.info("Restored checkpoint %d: policy version %d, next iteration %d, ledger %s",
                        resume_step, restored["version"], start, restored["ledger"])
        with on("engine"):
            placed("sync_weights", t.sync_weights.submit(trainer, engines).result())
        # The coordinator lives with the first env host; losing that worker ends the run (resume
        # from the last checkpoint), losing any other env worker costs only its episodes.
        rollout = client.submit(RolloutServiceActor, cfg_dict, root, run_id, engines, host_refs,
                                start, actor=True, workers=[env_workers[0]],
                                key=f"rollout-{run_id}").result()
        placed("rollout_service", rollout.start().result())
        logger.info("Rollout service: %d env host(s), max_staleness %d, redundancy %d",
                    len(hosts), cfg.rollout.max_staleness, cfg.rollout.redundancy)
        logger.info("Run %s: store %s; %d engine replica(s)", run_id, store.url, len(engines))
        progress.note(f"Checkpoints and metrics under {store.url}")

        artifacts = RunArtifacts(run_id, cfg.iterations)
        last_ckpt: dict[str, Any] | None = None
        final: dict[str, float] = {}
        for it in range(start, cfg.iterations):
            t0 = time.perf_counter()
            with on("env"):
                collected = t.collect.submit(rollout, it)
            with on("reward"):
                scored = t.score.submit(cfg_dict, root, run_id, it, collected)
            with on("trainer"):
                updated = t.update.submit(trainer, scored)
            step = it + 1
            checkpoint_due = step % cfg.storage.save_every == 0 or step == cfg.iterations
            # On a checkpoint iteration the next batch starts after the snapshot, so the
            # engines' sampling RNG is captured at rest (exact resume with max_staleness 0).
            with on("engine"):
                synced = t.sync_weights.submit(trainer, engines,
                                               None if checkpoint_due else rollout, step,
                                               wait_for=[updated])
            ckpt = None
            if checkpoint_due:
                with on("trainer"):
                    ckpt = t.checkpoint.submit(trainer, step, {"iteration": it}, engines,
                                               wait_for=[updated])
            ev = None
            if cfg.eval.episodes and (
                (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.iterations
            ):
                with on("env"):
                    ev = t.evaluate.submit(cfg_dict, root, run_id, engines, cfg.eval.episodes,
                                           wait_for=[synced])
            m: dict[str, Any] = {"iteration": float(it), "version": float(step)}
            m.update(placed("collect", collected.result()[1])["metrics"])
            m.update(placed("score", scored.result()[1])["metrics"])
            m.update(placed("update", updated.result())["metrics"])
            m.update(placed("sync_weights", synced.result())["metrics"])
            if ckpt is not None:
                last_ckpt = placed("checkpoint", ckpt.result())
                synced.result()  # the engines serve the new version before episodes start
                rollout.set_version(step).result()
                m["perf/checkpoint_s"] = last_ckpt["save_s"]  # blocking part; upload: below
                for up in last_ckpt.get("uploaded", []):  # background uploads finished since
                    m["perf/checkpoint_upload_s"] = up["result"]["upload_s"]
            if ev is not None:
                m.update(placed("evaluate", ev.result())["metrics"])
            m["perf/iteration_s"] = time.perf_counter() - t0
            store.append_jsonl("metrics.jsonl", m)
            row = summary_row(m)
            final = m
            logger.info(progress.format_row(row))
            progress.report(row)
            artifacts.iteration(step, row, m, last_ckpt if ckpt is not None else None)

        rollout_stats = rollout.stop().result()
        rollout_stats["env_hosts"] = [_host_stats(h) for h in hosts]
        logger.info("Rollout service: %s", rollout_stats["counters"])
        # The final checkpoint (and every background upload) is durable before the run ends.
        uploads = trainer.flush_checkpoints().result()
        shards = client.run(flush_all)
        logger.info("Uploads finished: %d checkpoint/weight upload(s), %d shard(s)",
                    len(uploads), sum(shards.values()))
        artifacts.finish(store)
        ckpt_path = last_ckpt["path"] if last_ckpt else None
        fingerprints = {"trainer": trainer.fingerprint().result(),
                        "engine": engines[0].fingerprint().result()}
    return {
        "run_id": run_id,
        "store": store.url,
        "checkpoint": ckpt_path,
        "final_metrics": final,
        "placement": placement,
        "fingerprints": fingerprints,
        "resumed_from": resume_step,
        "rollout": rollout_stats,
    }
