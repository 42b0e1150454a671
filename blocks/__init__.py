"""Prefect Block types of rollart, their registration, and how flows turn block names into
config overrides.

    RunStorage     (rollart-storage)         local directory or S3 bucket, secret credentials
    LambdaRewards  (rollart-lambda-rewards)  Lambda function or local endpoint, concurrency,
                                             failure policy, optional secret AWS credentials
    DaskCluster    (rollart-dask-cluster)    scheduler address, hardware-class map
    ModelSource    (rollart-model-source)    initial policy

A flow takes block *names* (`storage_block="local"`, ...). Each block contributes config
overrides (applied after the config file, before the run's own overrides, so an explicit
`--set` still wins) and, for secrets, environment variables: secrets never enter the config,
the logs or the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from blocks.cluster import DaskCluster
from blocks.model import ModelSource
from blocks.rewards import LambdaRewards
from blocks.storage import RunStorage

BLOCK_TYPES = (RunStorage, LambdaRewards, DaskCluster, ModelSource)

__all__ = ["BLOCK_TYPES", "DaskCluster", "LambdaRewards", "ModelSource", "ResolvedBlocks",
           "RunStorage", "register_block_types", "resolve_blocks"]


def register_block_types() -> list[str]:
    """Register (or update) the block types and schemas on the current Prefect API."""
    for cls in BLOCK_TYPES:
        cls.register_type_and_schema()
    return [cls.get_block_type_slug() for cls in BLOCK_TYPES]


@dataclass
class ResolvedBlocks:
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    used: dict[str, str] = field(default_factory=dict)  # block type slug -> document name
    storage: RunStorage | None = None

    def apply_environment(self) -> None:
        """Export the blocks' environment to this process (and so to the processes it starts,
        e.g. an embedded Dask cluster). Values are never logged."""
        os.environ.update(self.env)


def resolve_blocks(storage: str | None = None, rewards: str | None = None,
                   cluster: str | None = None, model: str | None = None) -> ResolvedBlocks:
    out = ResolvedBlocks()
    for cls, name in ((DaskCluster, cluster), (ModelSource, model), (LambdaRewards, rewards),
                      (RunStorage, storage)):
        if not name:
            continue
        try:
            block = cls.load(name)
        except ValueError as err:  # Prefect: "Unable to find block document named ..."
            raise ValueError(f"no {cls.get_block_type_slug()} block named {name!r}; "
                             "create it with `rollart deploy` or in the UI (Blocks)") from err
        out.overrides.extend(block.config_overrides())
        out.env.update(block.environment())
        out.used[cls.get_block_type_slug()] = name
        if isinstance(block, RunStorage):
            out.storage = block
    return out
