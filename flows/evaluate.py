"""Prefect flow `evaluate`: a checkpoint of a run, greedy episodes on held-out seeds.

The run's own config (`runs/{run_id}/config.yaml` in the store) rebuilds the policy; the
checkpoint's weights (the latest complete one unless `checkpoint` is given) are loaded into an
engine replica on the engine-class worker, and the episodes run on an env-class worker through
the same stage as the training loop's evaluation (`rollart.runner.stages.evaluate`). Results go to
the store (`eval/{step:08d}.json`) and to the flow run's artifacts.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

from distributed import Client
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from blocks import resolve_blocks
from blocks.secrets import CredentialsResolverPlugin, install_credentials_resolver
from flows.artifacts import artifact_key
from infra.clusters import open_cluster
from rollart import secrets
from rollart.config import check_run_id, load_config
from rollart.run import RunSpec
from rollart.services import EngineService
from rollart.storage.resume import stored_run_config
from rollart.storage.store import eval_rel
from tasks.stages import PrefectStages, task_runner


@flow(name="evaluate")
def evaluate(
    run_id: str,
    checkpoint: int | None = None,
    episodes: int = 32,
    overrides: list[str] | None = None,
    storage_root: str | None = None,
    scheduler_address: str | None = None,
    storage_block: str | None = None,
    cluster_block: str | None = None,
) -> dict[str, Any]:
    """Greedy evaluation of `run_id` at `checkpoint` (default: its latest complete one) on
    `episodes` held-out seeds. The store is `storage_root`, the storage block's, or the
    config default; the cluster is `scheduler_address`, the cluster block's, or embedded."""
    logger = get_run_logger()
    check_run_id(run_id)  # before the store is opened: the run id is a path in it
    blocks = resolve_blocks(storage=storage_block, cluster=cluster_block)
    blocks.apply_environment()
    install_credentials_resolver()
    where = [f"storage.root={json.dumps(storage_root)}"] if storage_root else []
    location = load_config(None, blocks.overrides + where).storage
    cluster_overrides = [o for o in blocks.overrides if o.startswith("cluster.")]
    run = RunSpec(stored_run_config(location, run_id, cluster_overrides + list(overrides or [])),
                  run_id)
    cfg, store = run.cfg, run.store()
    step = checkpoint if checkpoint is not None else store.latest_authentic_checkpoint()
    if step is None or step not in store.list_checkpoints():
        raise ValueError(f"run {run_id!r} has no complete checkpoint "
                         f"{'at step ' + str(step) if step is not None else 'yet'} "
                         f"(have {store.list_checkpoints()})")
    store.read_manifest(step)  # CheckpointRefused (one line) before any worker starts
    with contextlib.ExitStack() as stack:
        stack.enter_context(secrets.held_out_of_environment())  # no worker inherits a secret
        address = stack.enter_context(
            open_cluster(cfg.cluster, scheduler_address, dashboard=False)).address
        logger.info("Evaluating %s checkpoint %d: %d greedy episodes on held-out seeds (Dask %s)",
                    run_id, step, episodes, address)
        metrics = evaluate_on_cluster.with_options(task_runner=task_runner(cfg, address))(
            run, step, episodes, address)
    result = {"run_id": run_id, "checkpoint": step, "episodes": episodes, "metrics": metrics,
              "store": store.url}
    store.write_text(eval_rel(step), json.dumps(result, indent=2, sort_keys=True))
    rows = [{"metric": k, "value": round(float(v), 4)} for k, v in sorted(metrics.items())]
    create_table_artifact(rows, key=artifact_key(run_id, f"eval-{step}"),
                          description=f"Greedy evaluation of {run_id} at step {step}")
    success = metrics.get("eval/success_rate", float("nan"))
    create_markdown_artifact(
        f"## Evaluation of `{run_id}` at step {step}\n\n"
        f"- greedy success rate on {episodes} held-out episodes: **{success:.3f}**\n"
        f"- mean return: {metrics.get('eval/env_return', float('nan')):.3f}, "
        f"episode length {metrics.get('eval/episode_len', float('nan')):.2f}\n"
        f"- results: `{store.path(eval_rel(step))}`\n",
        key=artifact_key(run_id, "eval"), description=f"Evaluation of {run_id}")
    logger.info("Greedy success %.3f on %d held-out episodes", success, episodes)
    return result


@flow(name="evaluate-on-cluster", validate_parameters=False)
def evaluate_on_cluster(run: RunSpec, step: int, episodes: int, address: str) -> dict[str, float]:
    with Client(address) as client, secrets.on_cluster(client, run.cfg):
        if run.cfg.storage.credentials_block:
            client.register_plugin(CredentialsResolverPlugin())
        engine = client.submit(EngineService, run, 0, actor=True,
                               resources={run.cfg.cluster.stages["engine"]: 1},
                               key=f"eval-engine-{run.run_id}-{step}-{uuid.uuid4().hex[:8]}",
                               ).result()
        stages = PrefectStages(run.cfg)
        loaded = stages.submit("load_checkpoint_weights", engine, step)
        out = stages.info(stages.submit("evaluate", run, [engine], episodes, after=[loaded]))
        weights = stages.info(loaded)
    return {**out["metrics"], "eval/weight_version": float(weights["version"])}
