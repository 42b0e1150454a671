"""`RunStorage` block: where runs keep checkpoints, shards and metrics (local disk or S3)."""

from __future__ import annotations

import json
import os
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class RunStorage(Block):
    """The run store: a local directory, or an S3 bucket (AWS, SeaweedFS, MinIO) with its
    endpoint and credentials. Credentials are secret fields: the UI and API show them masked,
    and they reach the store through the standard AWS environment variables of the flow's
    process (and the processes it starts), never through the run config, logs or store."""

    _block_type_name: ClassVar[str] = "rollart storage"
    _block_type_slug: ClassVar[str] = "rollart-storage"
    _description: ClassVar[str] = "Run store of rollart: local directory or S3 bucket + prefix."

    root: str | None = Field(None, description="Local directory (absolute) when no bucket is set")
    bucket: str | None = Field(None, description="S3 bucket; runs go to s3://bucket/prefix")
    prefix: str = Field("", description="Key prefix inside the bucket")
    endpoint_url: str | None = Field(None, description="S3 endpoint; None for AWS S3")
    region: str = Field("us-east-1", description="S3 region")
    access_key_id: SecretStr | None = Field(None, description="S3 access key id (secret)")
    secret_access_key: SecretStr | None = Field(None, description="S3 secret key (secret)")

    def store_root(self) -> str:
        if self.bucket:
            return f"s3://{self.bucket}/{self.prefix.strip('/')}".rstrip("/")
        return os.path.abspath(self.root or "artifacts")

    def config_overrides(self) -> list[str]:
        out = [f"storage.root={json.dumps(self.store_root())}"]
        if self.bucket:
            out += [f"storage.endpoint_url={json.dumps(self.endpoint_url)}",
                    f"storage.region={json.dumps(self.region)}"]
        return out

    def environment(self) -> dict[str, str]:
        if self.bucket and self.access_key_id and self.secret_access_key:
            return {"AWS_ACCESS_KEY_ID": self.access_key_id.get_secret_value(),
                    "AWS_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value()}
        return {}
