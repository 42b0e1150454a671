"""`RunStorage` block: where runs keep checkpoints, shards and metrics (local disk or S3)."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from blocks.aws import (
    AwsCredentials,
    CredentialFields,
    S3Bucket,
    credential_fields,
    masked_repr_args,
)


class RunStorage(Block):
    """The run store: a local directory, or an S3 bucket (AWS, SeaweedFS, MinIO) with its
    endpoint and credentials. Credentials are secret fields, or a prefect-aws `AwsCredentials`
    block (`aws_credentials`, which also gives the endpoint and region unless they are set
    here): the UI and API show them masked, and they reach the store through the standard AWS
    environment variables of the flow's process (and the processes it starts), never through
    the run config, logs or store."""

    _block_type_name: ClassVar[str] = "rollart storage"
    _block_type_slug: ClassVar[str] = "rollart-storage"
    _description: ClassVar[str] = "Run store of rollart: local directory or S3 bucket + prefix."

    root: str | None = Field(None, description="Local directory (absolute) when no bucket is set")
    bucket: str | None = Field(None, description="S3 bucket; runs go to s3://bucket/prefix")
    prefix: str = Field("", description="Key prefix inside the bucket")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint; None: the credentials block's, else AWS S3")
    region: str | None = Field(
        None, description="S3 region; None: the credentials block's, else us-east-1")
    access_key_id: SecretStr | None = Field(None, description="S3 access key id (secret)")
    secret_access_key: SecretStr | None = Field(None, description="S3 secret key (secret)")
    aws_credentials: AwsCredentials | None = Field(
        None, description="prefect-aws AwsCredentials block: key pair (when the two fields "
                          "above are empty), region and endpoint_url (aws_client_parameters)")

    @classmethod
    def from_s3_bucket(cls, bucket: S3Bucket) -> RunStorage:
        """The store of a prefect-aws `S3Bucket` block: s3://bucket_name/bucket_folder, with its
        credentials block (AwsCredentials, or MinIOCredentials whose root user and password are
        the key pair)."""
        creds = bucket.credentials
        if isinstance(creds, AwsCredentials):
            return cls(bucket=bucket.bucket_name, prefix=bucket.bucket_folder or "",
                       aws_credentials=creds)
        fields = credential_fields(creds)
        return cls(bucket=bucket.bucket_name, prefix=bucket.bucket_folder or "",
                   endpoint_url=fields.endpoint_url, region=fields.region,
                   access_key_id=fields.access_key_id, secret_access_key=fields.secret_access_key)

    def _credentials(self) -> CredentialFields:
        return credential_fields(self.aws_credentials)

    def __repr_args__(self) -> list[tuple[str | None, Any]]:
        return masked_repr_args(super().__repr_args__())

    def store_root(self) -> str:
        if self.bucket:
            return f"s3://{self.bucket}/{self.prefix.strip('/')}".rstrip("/")
        return os.path.abspath(self.root or "artifacts")

    def config_overrides(self) -> list[str]:
        out = [f"storage.root={json.dumps(self.store_root())}"]
        if self.bucket:
            creds = self._credentials()
            out += [f"storage.endpoint_url={json.dumps(self.endpoint_url or creds.endpoint_url)}",
                    f"storage.region={json.dumps(self.region or creds.region or 'us-east-1')}"]
            if creds.profile and not self._own_keys() and not creds.has_keys:
                out.append(f"storage.profile={json.dumps(creds.profile)}")
        return out

    def _own_keys(self) -> bool:
        return bool(self.access_key_id and self.secret_access_key)

    def environment(self) -> dict[str, str]:
        if not self.bucket:
            return {}
        if self.access_key_id and self.secret_access_key:
            return {"AWS_ACCESS_KEY_ID": self.access_key_id.get_secret_value(),
                    "AWS_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value()}
        return self._credentials().storage_env()
