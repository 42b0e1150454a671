"""Block documents for the local stack, written by `rollart up` (its S3 server's) and
`rollart deploy` (all of them).

Each of rollart's types gets a document named `local` pointing at the running stack (Dask
scheduler, Lambda endpoint, run store), plus `tiny` for the model source. The stack's keys live
in prefect-aws blocks, the ones Prefect users already know:

    aws-credentials/local-s3      the SeaweedFS S3 server: key pair, region, endpoint_url
    s3-bucket/local               its bucket, with those credentials
    aws-credentials/local-lambda  the local Lambda endpoint: its key pair and endpoint_url
    rollart-storage/local         the run store: the bucket, credentials aws-credentials/local-s3
                                  (or a local directory when the stack has no S3 server)
    rollart-lambda-rewards/local  the endpoint, credentials aws-credentials/local-lambda

So the default deployments (`storage_block: local`, `rewards_block: local`) use the prefect-aws
documents, and `s3-bucket/local` works as a run's `storage_block` too. Existing documents are
overwritten (updated in place, so references stay valid): re-deploying after `rollart up`
picked new ports keeps the blocks current.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from prefect_aws.client_parameters import AwsClientParameters

from blocks import (
    DaskCluster,
    LambdaRewards,
    ModelSource,
    RunStorage,
    register_block_types,
)
from blocks.aws import AwsCredentials, S3Bucket
from rollart.config.hardware import default_workers

if TYPE_CHECKING:
    from rollart.rewards.client import LambdaCredentials

LOCAL = "local"
LOCAL_S3_CREDENTIALS = "local-s3"
LOCAL_LAMBDA_CREDENTIALS = "local-lambda"
LOCAL_REGION = "us-east-1"


def _credentials(key: str, secret: str, endpoint_url: str | None) -> AwsCredentials:
    return AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret,
                          region_name=LOCAL_REGION,
                          aws_client_parameters=AwsClientParameters(endpoint_url=endpoint_url))


def _ref(cls: Any, name: str) -> str:
    return f"{cls.get_block_type_slug()}/{name}"


def register_s3_blocks(s3: dict[str, Any]) -> tuple[AwsCredentials, list[str]]:
    """Save `aws-credentials/local-s3` and `s3-bucket/local` for the stack's S3 server. `s3`:
    endpoint_url, bucket, access_key_id, secret_access_key (optional prefix). Registers the
    prefect-aws types first. Returns the saved credentials and the documents (`slug/name`)."""
    for cls in (AwsCredentials, S3Bucket):
        cls.register_type_and_schema()
    creds = _credentials(s3["access_key_id"], s3["secret_access_key"], s3.get("endpoint_url"))
    creds.save(LOCAL_S3_CREDENTIALS, overwrite=True)
    S3Bucket(bucket_name=s3["bucket"], bucket_folder=s3.get("prefix", ""),
             credentials=creds).save(LOCAL, overwrite=True)
    return creds, [_ref(AwsCredentials, LOCAL_S3_CREDENTIALS), _ref(S3Bucket, LOCAL)]


def register_local_blocks(stack: dict[str, Any], storage_root: str | None = None,
                          s3: dict[str, Any] | None = None,
                          lambda_credentials: LambdaCredentials | None = None,
                          ) -> list[str]:
    """Register the block types, then save the stack's documents. `stack` is
    `Stack.status_json()`; `s3` (endpoint_url, bucket, access_key_id, secret_access_key) uses
    the stack's S3 server instead of `storage_root`; `lambda_credentials` is the key pair the
    stack's Lambda endpoint accepts. Keys go into prefect-aws AwsCredentials documents (secret
    fields), which ours reference. Returns the documents saved (`slug/name`)."""
    register_block_types()
    saved: list[str] = []
    workers = stack.get("classes") or default_workers()
    cluster = DaskCluster(scheduler_address=stack.get("scheduler_address"),
                          dashboard_url=stack.get("dashboard_url"), workers=dict(workers))
    cluster.save(LOCAL, overwrite=True)
    saved.append(_ref(DaskCluster, LOCAL))
    # The stack's endpoint; without a stack, each run starts its own (embedded) endpoint.
    lambda_url = stack.get("lambda_url")
    lambda_creds = None
    if lambda_credentials is not None:
        lambda_creds = _credentials(lambda_credentials.access_key, lambda_credentials.secret_key,
                                    lambda_url)
        lambda_creds.save(LOCAL_LAMBDA_CREDENTIALS, overwrite=True)
        saved.append(_ref(AwsCredentials, LOCAL_LAMBDA_CREDENTIALS))
    LambdaRewards(endpoint_url=lambda_url, embedded_endpoint=True, max_concurrency=4,
                  aws_credentials=lambda_creds).save(LOCAL, overwrite=True)
    saved.append(_ref(LambdaRewards, LOCAL))
    if s3:
        s3_creds, aws = register_s3_blocks(s3)
        saved += aws
        storage = RunStorage(bucket=s3["bucket"], prefix=s3.get("prefix", ""),
                             aws_credentials=s3_creds)
    else:
        storage = RunStorage(root=os.path.abspath(storage_root or "artifacts"))
    storage.save(LOCAL, overwrite=True)
    saved.append(_ref(RunStorage, LOCAL))
    ModelSource().save("tiny", overwrite=True)
    saved.append(_ref(ModelSource, "tiny"))
    return saved
