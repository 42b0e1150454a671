"""Prefect flow `continue-training`: the scheduled deployment's entry point.

Each run adds `add_iterations` to a named run: it finds the run's latest complete checkpoint in
the store and runs `train` as a subflow with `resume=<run_id>` and `iterations=<step + N>`
(a resumed run keeps its config; `iterations` is the one override that extends it). The first
time, when the run has no checkpoint yet, it starts the run with `iterations=N`. So a nightly
schedule grows one run by N iterations a night, each night resuming exactly where the last
complete checkpoint left off.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from blocks import resolve_blocks
from flows.train import train
from rollart.config import check_run_id, load_config
from rollart.storage.store import RunStore


@flow(name="continue-training")
def continue_training(
    run_id: str,
    add_iterations: int = 20,
    config: str = "configs/default.yaml",
    overrides: list[str] | None = None,
    storage_block: str | None = None,
    rewards_block: str | None = None,
    cluster_block: str | None = None,
    model_block: str | None = None,
) -> dict[str, Any]:
    """Continue `run_id` from its latest checkpoint for `add_iterations` more iterations (or
    start it, the first time)."""
    if add_iterations < 1:
        raise ValueError("add_iterations must be >= 1")
    check_run_id(run_id)  # before the store is opened: the run id is a path in it
    logger = get_run_logger()
    found = resolve_blocks(storage=storage_block)
    found.apply_environment()
    cfg = load_config(config, found.overrides + list(overrides or []))
    store = RunStore.from_config(cfg.storage, run_id)
    step = store.latest_authentic_checkpoint() if store.exists("config.yaml") else None
    blocks = {"storage_block": storage_block, "rewards_block": rewards_block,
              "cluster_block": cluster_block, "model_block": model_block}
    if step is None:
        logger.info("Run %s has no checkpoint under %s: starting it for %d iteration(s)",
                    run_id, store.url, add_iterations)
        return train(config=config, run_id=run_id,
                     overrides=[*(overrides or []), f"iterations={add_iterations}"], **blocks)
    logger.info("Run %s: resuming from checkpoint %d for %d more iteration(s)", run_id, step,
                add_iterations)
    return train(config=config, resume=run_id,
                 overrides=[*(overrides or []), f"iterations={step + add_iterations}"], **blocks)
