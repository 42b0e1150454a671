"""Block documents for the local stack, written by `rollart deploy`.

Each type gets a document named `local` pointing at the running stack (Dask scheduler, Lambda
endpoint, run store), plus `tiny` for the model source. Existing documents are overwritten, so
re-deploying after `rollart up` picked new ports keeps the blocks current.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from blocks import (
    DaskCluster,
    LambdaRewards,
    ModelSource,
    RunStorage,
    register_block_types,
)
from rollart.cluster_classes import default_workers

if TYPE_CHECKING:
    from rollart.rewards.client import LambdaCredentials

LOCAL = "local"


def register_local_blocks(stack: dict[str, Any], storage_root: str | None = None,
                          s3: dict[str, Any] | None = None,
                          lambda_credentials: LambdaCredentials | None = None) -> dict[str, str]:
    """Register the block types, then save the stack's documents. `stack` is
    `Stack.status_json()`; `s3` (endpoint_url, bucket, access_key_id, secret_access_key) uses
    the stack's S3 server instead of `storage_root`; `lambda_credentials` is the key pair the
    stack's Lambda endpoint accepts (stored as block secrets). Returns {type slug: name}."""
    register_block_types()
    saved: dict[str, str] = {}
    workers = stack.get("classes") or default_workers()
    cluster = DaskCluster(scheduler_address=stack.get("scheduler_address"),
                          dashboard_url=stack.get("dashboard_url"), workers=dict(workers))
    cluster.save(LOCAL, overwrite=True)
    saved[DaskCluster.get_block_type_slug()] = LOCAL
    # The stack's endpoint; without a stack, each run starts its own (embedded) endpoint.
    keys = {} if lambda_credentials is None else {
        "aws_access_key_id": lambda_credentials.access_key,
        "aws_secret_access_key": lambda_credentials.secret_key}
    LambdaRewards(endpoint_url=stack.get("lambda_url"), embedded_endpoint=True,
                  max_concurrency=4, **keys).save(LOCAL, overwrite=True)
    saved[LambdaRewards.get_block_type_slug()] = LOCAL
    if s3:
        storage = RunStorage(bucket=s3["bucket"], prefix=s3.get("prefix", ""),
                             endpoint_url=s3.get("endpoint_url"),
                             access_key_id=s3.get("access_key_id"),
                             secret_access_key=s3.get("secret_access_key"))
    else:
        storage = RunStorage(root=os.path.abspath(storage_root or "artifacts"))
    storage.save(LOCAL, overwrite=True)
    saved[RunStorage.get_block_type_slug()] = LOCAL
    ModelSource().save("tiny", overwrite=True)
    saved[ModelSource.get_block_type_slug()] = "tiny"
    return saved
