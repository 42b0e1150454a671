"""`LambdaRewards` block: how episodes are scored (AWS Lambda or the local endpoint)."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from blocks.aws import (
    AwsCredentials,
    CredentialFields,
    LambdaFunction,
    credential_fields,
    masked_repr_args,
)


class LambdaRewards(Block):
    """Reward scoring through Lambda: a function name (or ARN) on AWS, or the local endpoint
    of `rollart up` (`endpoint_url`), with client-side concurrency and a handler-error policy.
    The key pair is the two secret fields, else a prefect-aws `AwsCredentials` block
    (`aws_credentials`, which also gives the region and endpoint unless they are set here)."""

    _block_type_name: ClassVar[str] = "rollart lambda rewards"
    _block_type_slug: ClassVar[str] = "rollart-lambda-rewards"
    _description: ClassVar[str] = "Reward functions of rollart on AWS Lambda or a local endpoint."

    function_name: str = Field("rollart-env-outcome", description="Lambda function name or ARN")
    handler: str = Field("env_outcome", description="Reward handler the function runs")
    alias: str | None = Field(None, description="Lambda qualifier: alias or version")
    endpoint_url: str | None = Field(
        None, description="Local endpoint URL; None: the credentials block's, else AWS Lambda")
    embedded_endpoint: bool = Field(
        False, description="No endpoint_url: start a local endpoint per run instead of AWS")
    region: str | None = Field(
        None, description="AWS region; None: the credentials block's, else us-east-1")
    max_concurrency: int = Field(32, ge=1, le=1000, description="Invocations in flight")
    timeout_s: float = Field(60.0, gt=0, le=900)
    max_retries: int = Field(5, ge=0, le=50, description="Retries of a handler error")
    retry_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Retry throttles, 5xx and endpoint outages this long")
    on_error: Literal["retry", "zero", "fail"] = Field(
        "retry", description="Handler error: retry then fail, score 0 and flag, or fail the run")
    aws_access_key_id: SecretStr | None = Field(
        None, description="Key pair the calls are signed with: AWS Lambda's, or the local "
                          "endpoint's (secret)")
    aws_secret_access_key: SecretStr | None = Field(None, description="(secret)")
    aws_credentials: AwsCredentials | None = Field(
        None, description="prefect-aws AwsCredentials block: key pair (when the two fields "
                          "above are empty), region and endpoint_url (aws_client_parameters)")

    @classmethod
    def from_lambda_function(cls, function: LambdaFunction, **settings: Any) -> LambdaRewards:
        """Rewards from a prefect-aws `LambdaFunction` block: its function_name, qualifier (the
        alias) and AwsCredentials; `settings` sets the fields it has no counterpart for
        (handler, max_concurrency, ...)."""
        return cls(function_name=function.function_name, alias=function.qualifier,
                   aws_credentials=function.aws_credentials, **settings)

    def _credentials(self) -> CredentialFields:
        return credential_fields(self.aws_credentials)

    def _endpoint(self) -> str | None:
        return self.endpoint_url or self._credentials().endpoint_url

    def __repr_args__(self) -> list[tuple[str | None, Any]]:
        return masked_repr_args(super().__repr_args__())

    def config_overrides(self) -> list[str]:
        endpoint = self._endpoint()
        values = {
            "backend": "lambda", "function": self.handler, "function_name": self.function_name,
            "alias": self.alias, "endpoint_url": endpoint,
            "region": self.region or self._credentials().region or "us-east-1",
            "embedded_endpoint": self.embedded_endpoint and not endpoint,
            "max_concurrency": self.max_concurrency,
            "timeout_s": self.timeout_s, "max_retries": self.max_retries,
            "retry_timeout_s": self.retry_timeout_s,
            "on_error": self.on_error,
        }
        return [f"reward.{k}={json.dumps(v)}" for k, v in values.items()]

    def environment(self) -> dict[str, str]:
        """The key pair for the run's process. For a loopback endpoint it is the local
        endpoint's own pair (ROLLART_LAMBDA_*), kept apart from AWS_* (the storage keys)."""
        from rollart.rewards.client import LambdaCredentials, is_loopback

        if self.aws_access_key_id and self.aws_secret_access_key:
            creds = CredentialFields(self.aws_access_key_id.get_secret_value(),
                                     self.aws_secret_access_key.get_secret_value())
        else:
            creds = self._credentials()
        if not creds.has_keys:
            return {}
        if is_loopback(self._endpoint()):
            return LambdaCredentials(str(creds.access_key_id), str(creds.secret_access_key)).env()
        return creds.storage_env()
