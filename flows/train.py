"""Prefect flow `train`: each RL iteration is a DAG of stage tasks on hardware-class Dask workers.

    collect (env class) -> score (reward class) -> update (trainer class)
        -> sync_weights (engine class) -> [checkpoint (trainer class)] [evaluate (env class)]

The flow only orchestrates: it validates the config, starts or connects to the Dask cluster,
and hands the iteration driver (`rollart/runner/driver.py`, the same loop the in-process mode runs)
a runner that submits each stage as a Prefect task annotated with its class and a factory that
creates the long-lived services as Dask actors on their classes; then it reports each
iteration (log, terminal, artifacts).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from distributed import Client
from prefect import flow, get_run_logger
from prefect.states import Failed

from blocks import resolve_blocks
from blocks.secrets import CredentialsResolverPlugin, install_credentials_resolver
from flows.artifacts import RunArtifacts
from infra.clusters import open_cluster
from infra.lambda_endpoint import with_embedded_endpoint
from rollart import secrets
from rollart.config import ConfigError, RunConfig, check_run_id, load_config
from rollart.metrics import summary_row
from rollart.run import RunSpec
from rollart.runner import progress
from rollart.runner.dask_services import DaskServices
from rollart.runner.driver import IterationDriver, IterationResult, Placement
from rollart.runner.lifecycle import drive_run, started_run
from rollart.storage.resume import ResumeError, describe
from rollart.storage.s3 import StorageError
from tasks.stages import PrefectStages, task_runner


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
    `overrides`; their secrets stay in this process's memory for the run and reach only the
    workers whose class uses them (rollart/secrets.py), never the config or the logs.
    `resume` (a run id) continues that run from its latest complete checkpoint."""
    blocks = resolve_blocks(storage_block, rewards_block, cluster_block, model_block)
    # invalid config fails before any cluster starts
    cfg = load_config(config, blocks.overrides + list(overrides or []))
    blocks.apply_environment()
    install_credentials_resolver()  # storage.credentials_block, in this process
    # For the whole run the secrets live in this process's memory, not its environment: worker
    # processes it starts inherit none; each worker gets what its class needs (on_cluster).
    with secrets.held_out_of_environment():
        return _train(cfg, blocks.overrides + list(overrides or []), scheduler_address, run_id,
                      resume)


def _train(cfg: RunConfig, overrides: list[str], scheduler_address: str | None,
           run_id: str | None, resume: str | None) -> Any:
    if resume and run_id and run_id != resume:
        return Failed(message=f"run_id {run_id!r} and resume {resume!r} differ")
    run_id = resume or run_id or new_run_id(cfg.name)
    try:  # before the store is opened: the run id is a path in it
        check_run_id(run_id, "resume" if resume else "run_id")
    except ConfigError as err:
        return Failed(message=str(err))
    logger = get_run_logger()
    with contextlib.ExitStack() as stack:
        # The run's lifecycle (rollart/runner/lifecycle.py), as in the in-process mode: one writer
        # per run id (a second train/resume of it fails here, naming us), store reachable with
        # these credentials, run id reuse and resume guards; before any cluster starts. Entered
        # first, so the lock is released last, at the run's end or abort alike.
        try:
            started = stack.enter_context(
                started_run(cfg, run_id, resume=bool(resume), overrides=overrides))
        except (StorageError, ResumeError) as err:
            return Failed(message=str(err))
        cfg, point = started.cfg, started.point
        if point is not None:
            logger.info(describe(point))
            progress.note(describe(point).capitalize())
        # Before the cluster: the endpoint's key pair is held here and goes to the workers that
        # score rewards (secrets.on_cluster in `iterations`).
        cfg = with_embedded_endpoint(cfg, stack)
        cluster = stack.enter_context(open_cluster(cfg.cluster, scheduler_address))
        address = cluster.address
        if cluster.manager != "address":
            logger.info("Dask cluster (%s) %s, dashboard %s", cluster.manager, address,
                        cluster.dashboard)
            progress.note(f"Dask dashboard:  {cluster.dashboard}")
        from prefect.runtime import flow_run

        progress.note(f"Prefect flow run: {flow_run.ui_url}")
        if cfg.reward.endpoint_url and cfg.reward.embedded_endpoint:
            progress.note(f"Rewards:         local Lambda endpoint {cfg.reward.endpoint_url}")
        return iterations.with_options(task_runner=task_runner(cfg, address))(
            RunSpec(cfg, run_id), address, started.resume_step
        )


@flow(name="iterations", validate_parameters=False)
def iterations(run: RunSpec, address: str, resume_step: int | None = None) -> dict[str, Any]:
    cfg, run_id = run.cfg, run.run_id
    logger = get_run_logger()
    artifacts = RunArtifacts(run_id, cfg.iterations)
    placed = Placement()
    saved: list[dict[str, Any]] = []  # checkpoint stage results, in order

    def report(res: IterationResult) -> None:
        saved.extend([res.checkpoint] if res.checkpoint else [])
        row = summary_row(res.metrics)
        logger.info(progress.format_row(row))
        progress.report(row)
        artifacts.iteration(res.plan.step, row, res.metrics, res.checkpoint)

    with Client(address) as client, secrets.on_cluster(client, cfg):
        if cfg.storage.credentials_block:  # workers resolve the secret block themselves
            client.register_plugin(CredentialsResolverPlugin())
        services = DaskServices(client, run, placed)

        def make_driver(run: RunSpec, attempt: int) -> IterationDriver:
            if attempt:  # a lost trainer or rollout service: new actors where workers are now
                services.restart()
            return IterationDriver(run, PrefectStages(cfg), services, placed)

        def restarted(r: dict[str, Any]) -> None:
            logger.warning("The %s was lost: restarting from checkpoint %d (restart %d of %d)",
                           r["lost"], r["from_checkpoint"], r["attempt"],
                           cfg.cluster.max_restarts)
            progress.note(f"Restart {r['attempt']}: the {r['lost']} was lost; resumed from "
                          f"checkpoint {r['from_checkpoint']}")

        out = drive_run(run, make_driver, resume_step, max_restarts=cfg.cluster.max_restarts,
                        on_iteration=report, on_restart=restarted)
        driver, curve, done, restarts = out.driver, out.curve, out.done, out.restarts
        if driver.restored is not None:
            logger.info("Restored checkpoint: policy version %d, ledger %s",
                        driver.restored["version"], driver.restored["ledger"])
        logger.info("Run %s: store %s; %d engine replica(s), %d env host(s), max_staleness %d",
                    run_id, driver.store.url, len(driver.svc.engines), len(driver.svc.hosts),
                    cfg.rollout.max_staleness)
        logger.info("Rollout service: %s", done["rollout"]["counters"])
        logger.info("Uploads finished: %d checkpoint/weight upload(s), %d shard(s)",
                    len(done["uploads"]), done["shards_flushed"])
        artifacts.finish(driver.store)
    return {
        "run_id": run_id,
        "store": driver.store.url,
        "checkpoint": saved[-1]["path"] if saved else None,
        "final_metrics": curve[-1] if curve else {},
        "placement": placed.by_stage,
        "fingerprints": done["fingerprints"],
        "resumed_from": resume_step,
        "rollout": done["rollout"],
        "restarts": restarts,
    }
