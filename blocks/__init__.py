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

The store and the rewards may also be prefect-aws blocks (blocks/aws.py): `storage_block` an
`S3Bucket`, `rewards_block` a `LambdaFunction`. A name `TYPE-SLUG/NAME` picks the type
(`s3-bucket/data`); a plain name is looked up as rollart's type first, then prefect-aws's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from prefect.blocks.core import Block

from blocks.aws import AwsCredentials, LambdaFunction, S3Bucket
from blocks.cluster import DaskCluster
from blocks.model import ModelSource
from blocks.rewards import LambdaRewards
from blocks.storage import RunStorage

BLOCK_TYPES = (RunStorage, LambdaRewards, DaskCluster, ModelSource)
# prefect-aws types registered alongside ours (the local stack writes documents of the first two)
AWS_BLOCK_TYPES = (AwsCredentials, S3Bucket, LambdaFunction)
# The types a flow's block name may refer to, per parameter (ours first).
ACCEPTED: dict[str, tuple[type[Block], ...]] = {
    "cluster": (DaskCluster,), "model": (ModelSource,),
    "rewards": (LambdaRewards, LambdaFunction), "storage": (RunStorage, S3Bucket)}

__all__ = ["ACCEPTED", "AWS_BLOCK_TYPES", "BLOCK_TYPES", "DaskCluster", "LambdaRewards",
           "ModelSource", "ResolvedBlocks", "RunStorage", "load_block", "register_block_types",
           "resolve_blocks"]


def register_block_types() -> list[str]:
    """Register (or update) the block types and schemas on the current Prefect API: ours and
    the prefect-aws types runs accept."""
    for cls in (*BLOCK_TYPES, *AWS_BLOCK_TYPES):
        cls.register_type_and_schema()
    return [cls.get_block_type_slug() for cls in BLOCK_TYPES]


def _not_found(err: ValueError) -> bool:
    return "Unable to find block document" in str(err)


def load_block(role: str, name: str) -> tuple[Block, str]:
    """The block a flow's `{role}_block` parameter names, as rollart's own type (a prefect-aws
    `S3Bucket` becomes a `RunStorage`, a `LambdaFunction` a `LambdaRewards`), and the slug of the
    type it was found as. `name` is `NAME` (each accepted type in turn) or `TYPE-SLUG/NAME`."""
    accepted = ACCEPTED[role]
    slugs = [cls.get_block_type_slug() for cls in accepted]
    slug, sep, doc = name.rpartition("/")
    if sep:
        if slug not in slugs:
            raise ValueError(f"{role}_block {name!r}: a {slug!r} block cannot be used here "
                             f"(accepted types: {', '.join(slugs)})")
        candidates: tuple[type[Block], ...] = (accepted[slugs.index(slug)],)
    else:
        candidates, doc = accepted, name
    for cls in candidates:
        try:
            block: Any = cls.load(doc)
        except ValueError as err:  # Prefect: "Unable to find block document named ..."
            if _not_found(err):
                continue
            raise
        if isinstance(block, S3Bucket):
            block = RunStorage.from_s3_bucket(block)
        elif isinstance(block, LambdaFunction):
            block = LambdaRewards.from_lambda_function(block)
        return block, cls.get_block_type_slug()
    tried = " or ".join(c.get_block_type_slug() for c in candidates)
    raise ValueError(f"no {tried} block named {doc!r}; "
                     "create it with `rollart deploy` or in the UI (Blocks)")


@dataclass
class ResolvedBlocks:
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    used: dict[str, str] = field(default_factory=dict)  # block type slug -> document name
    storage: RunStorage | None = None

    def add(self, block: Any, slug: str, name: str) -> None:
        """Take `block`'s overrides and environment. Two blocks that set one variable to two
        values (the store's and AWS Lambda's key pairs: a run signs both with one) are refused,
        naming the variable, never a value."""
        env = block.environment()
        clash = sorted(k for k, v in env.items() if self.env.get(k, v) != v)
        if clash:
            raise ValueError(f"block {slug}/{name} sets {', '.join(clash)} to another value than "
                             "a block before it: a run signs its S3 and AWS Lambda calls with one "
                             "key pair; give both blocks the same AwsCredentials")
        self.overrides.extend(block.config_overrides())
        self.env.update(env)
        self.used[slug] = name
        if isinstance(block, RunStorage):
            self.storage = block

    def apply_environment(self) -> None:
        """Export the blocks' environment to this process (and so to the processes it starts,
        e.g. an embedded Dask cluster). Values are never logged."""
        os.environ.update(self.env)


def resolve_blocks(storage: str | None = None, rewards: str | None = None,
                   cluster: str | None = None, model: str | None = None) -> ResolvedBlocks:
    out = ResolvedBlocks()
    for role, name in (("cluster", cluster), ("model", model), ("rewards", rewards),
                       ("storage", storage)):
        if not name:
            continue
        block, slug = load_block(role, name)
        out.add(block, slug, name.rpartition("/")[2])
    return out
