"""Prefect flow `evaluate`: a checkpoint of a run, greedy episodes on held-out seeds.

The run's own config (`runs/{run_id}/config.yaml` in the store) rebuilds the policy; the
checkpoint's weights (the latest complete one unless `checkpoint` is given) are loaded into an
engine replica on the engine-class worker, and the episodes run on an env-class worker through
the same stage as the training loop's evaluation (`rollart.stages.evaluate`). Results go to the
store (`eval/{step:08d}.json`) and to the flow run's artifacts.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

import dask
import yaml
from distributed import Client
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect_dask import DaskTaskRunner

import tasks.stages as t
from blocks import resolve_blocks
from flows.artifacts import artifact_key
from infra.dask_cluster import HardwareClassCluster
from rollart.config import (
    ConfigError,
    StorageConfig,
    apply_overrides,
    config_from_dict,
    load_config,
)
from rollart.services import EngineService
from rollart.storage.resume import LOCATION_KEYS
from rollart.storage.store import RunStore


@task(name="load_checkpoint", cache_policy=NONE, persist_result=False)
def load_checkpoint(engine: Any, cfg_dict: dict[str, Any], root: str, run_id: str,
                    step: int) -> dict[str, Any]:
    """On the engine worker: read the checkpoint from the store and push it into the engine.
    Tied weights are stored once, so the state goes through a model of the run's architecture
    (strict=False restores the ties) before the engine's strict load."""
    import safetensors.torch

    from rollart.services import build_model, param_checksum, worker_identity
    from rollart.stages import call

    cfg = config_from_dict(cfg_dict)
    store = RunStore.from_config(cfg.storage, run_id)
    manifest = json.loads(store.read_text(f"checkpoints/{step:08d}/manifest.json"))
    saved = safetensors.torch.load(store.read_bytes(f"checkpoints/{step:08d}/model.safetensors"))
    model, _ = build_model(cfg, root, run_id)
    model.load_state_dict(saved, strict=False)
    version = int(manifest.get("version", step))
    call(engine, "update_weights", version, model.state_dict())
    served, expected = call(engine, "fingerprint"), param_checksum(model)
    if abs(served - expected) > 1e-6 * max(1.0, abs(expected)):
        raise RuntimeError(f"engine weights differ from checkpoint {step} after loading")
    return {"step": step, "version": version, "fingerprint": served, **worker_identity()}


def run_config(location: StorageConfig, run_id: str, overrides: list[str]) -> dict[str, Any]:
    """The run's stored config + `overrides`; where the store is comes from `location`."""
    store = RunStore.from_config(location, run_id)
    if not store.exists("config.yaml"):
        raise ConfigError(f"run {run_id!r} not found under {store.url} (no config.yaml)")
    data = yaml.safe_load(store.read_text("config.yaml")) or {}
    data = apply_overrides(data, overrides)
    data["storage"] = {**data.get("storage", {}),
                       **{k: getattr(location, k) for k in LOCATION_KEYS}}
    return config_from_dict(data).model_dump(mode="json")


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
    blocks = resolve_blocks(storage=storage_block, cluster=cluster_block)
    blocks.apply_environment()
    where = [f"storage.root={json.dumps(storage_root)}"] if storage_root else []
    location = load_config(None, blocks.overrides + where).storage
    cluster_overrides = [o for o in blocks.overrides if o.startswith("cluster.")]
    cfg_dict = run_config(location, run_id, cluster_overrides + list(overrides or []))
    cfg = config_from_dict(cfg_dict)
    root = cfg.storage.root
    store = RunStore.from_config(cfg.storage, run_id)
    step = checkpoint if checkpoint is not None else store.latest_checkpoint()
    if step is None or step not in store.list_checkpoints():
        raise ValueError(f"run {run_id!r} has no complete checkpoint "
                         f"{'at step ' + str(step) if step is not None else 'yet'} "
                         f"(have {store.list_checkpoints()})")
    address = scheduler_address or cfg.cluster.address
    with contextlib.ExitStack() as stack:
        if address is None:
            cluster = stack.enter_context(HardwareClassCluster(
                workers=cfg.cluster.workers, threads_per_worker=cfg.cluster.threads_per_worker,
                dashboard=False))
            address = cluster.scheduler_address
        logger.info("Evaluating %s checkpoint %d: %d greedy episodes on held-out seeds (Dask %s)",
                    run_id, step, episodes, address)
        runner = DaskTaskRunner(address=address)
        metrics = evaluate_on_cluster.with_options(task_runner=runner)(
            cfg_dict, root, run_id, step, episodes, address)
    result = {"run_id": run_id, "checkpoint": step, "episodes": episodes, "metrics": metrics,
              "store": store.url}
    store.write_text(f"eval/{step:08d}.json", json.dumps(result, indent=2, sort_keys=True))
    rows = [{"metric": k, "value": round(float(v), 4)} for k, v in sorted(metrics.items())]
    create_table_artifact(rows, key=artifact_key(run_id, f"eval-{step}"),
                          description=f"Greedy evaluation of {run_id} at step {step}")
    success = metrics.get("eval/success_rate", float("nan"))
    create_markdown_artifact(
        f"## Evaluation of `{run_id}` at step {step}\n\n"
        f"- greedy success rate on {episodes} held-out episodes: **{success:.3f}**\n"
        f"- mean return: {metrics.get('eval/env_return', float('nan')):.3f}, "
        f"episode length {metrics.get('eval/episode_len', float('nan')):.2f}\n"
        f"- results: `{store.path(f'eval/{step:08d}.json')}`\n",
        key=artifact_key(run_id, "eval"), description=f"Evaluation of {run_id}")
    logger.info("Greedy success %.3f on %d held-out episodes", success, episodes)
    return result


@flow(name="evaluate-on-cluster")
def evaluate_on_cluster(cfg_dict: dict[str, Any], root: str, run_id: str, step: int,
                        episodes: int, address: str) -> dict[str, float]:
    stages = config_from_dict(cfg_dict).cluster.stages
    with Client(address) as client:
        engine = client.submit(EngineService, cfg_dict, root, run_id, 0, actor=True,
                               resources={stages["engine"]: 1},
                               key=f"eval-engine-{run_id}-{step}-{uuid.uuid4().hex[:8]}",
                               ).result()
        with dask.annotate(resources={stages["engine"]: 1}):
            loaded = load_checkpoint.submit(engine, cfg_dict, root, run_id, step)
        with dask.annotate(resources={stages["env"]: 1}):
            out = t.evaluate.submit(cfg_dict, root, run_id, [engine], episodes,
                                    wait_for=[loaded]).result()
        weights = loaded.result()
    return {**out["metrics"], "eval/weight_version": float(weights["version"])}
