"""prefect-aws blocks as a run's store and reward credentials.

Prefect users keep their AWS settings in prefect-aws blocks; rollart reads them where it reads
its own:

    AwsCredentials   (aws-credentials)    key pair, session token, region, endpoint URL
                                          (aws_client_parameters.endpoint_url)
    MinIOCredentials (minio-credentials)  the same for a MinIO server (root user and password)
    S3Bucket         (s3-bucket)          bucket_name + bucket_folder + one of the two above:
                                          a run store (`storage_block`)
    LambdaFunction   (lambda-function)    function_name + qualifier + AwsCredentials:
                                          the reward function (`rewards_block`)

Our own RunStorage and LambdaRewards blocks also take an `AwsCredentials` (`aws_credentials`).

`CredentialFields` reduces either credentials block to what a run needs: the endpoint and
region go into the config, the keys only into the run's secret environment (rollart.secrets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect_aws import AwsCredentials, LambdaFunction, S3Bucket
from prefect_aws.credentials import MinIOCredentials

AwsLikeCredentials = AwsCredentials | MinIOCredentials

__all__ = ["AwsCredentials", "AwsLikeCredentials", "CredentialFields", "LambdaFunction",
           "MinIOCredentials", "S3Bucket", "credential_fields", "masked_credentials",
           "masked_repr_args"]


def _plain(value: Any) -> str | None:
    if value is None:
        return None
    text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
    return text or None


@dataclass(frozen=True)
class CredentialFields:
    """What a run takes from a prefect-aws credentials block. The key fields are left out of
    the repr: print one freely."""

    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    region: str | None = None
    endpoint_url: str | None = None
    profile: str | None = None

    @property
    def has_keys(self) -> bool:
        return bool(self.access_key_id and self.secret_access_key)

    def storage_env(self) -> dict[str, str]:
        """The standard AWS variables (rollart.secrets.STORAGE_VARS) for the key pair."""
        if not self.has_keys:
            return {}
        env = {"AWS_ACCESS_KEY_ID": str(self.access_key_id),
               "AWS_SECRET_ACCESS_KEY": str(self.secret_access_key)}
        if self.session_token:
            env["AWS_SESSION_TOKEN"] = self.session_token
        return env


def credential_fields(creds: AwsLikeCredentials | None) -> CredentialFields:
    """The run's view of an `AwsCredentials` or `MinIOCredentials` block (None: nothing).
    An assumed role is refused: its temporary keys would expire in the middle of a run."""
    if creds is None:
        return CredentialFields()
    params = getattr(creds, "aws_client_parameters", None)
    endpoint = getattr(params, "endpoint_url", None) or None
    region = getattr(creds, "region_name", None) or None
    if isinstance(creds, MinIOCredentials):
        return CredentialFields(_plain(creds.minio_root_user), _plain(creds.minio_root_password),
                                None, region, endpoint)
    if getattr(creds, "assume_role_arn", None):
        raise ValueError("AwsCredentials with assume_role_arn are not supported for a run: "
                         "give the block a key pair (or a profile) instead")
    return CredentialFields(_plain(creds.aws_access_key_id), _plain(creds.aws_secret_access_key),
                            _plain(creds.aws_session_token), region, endpoint,
                            getattr(creds, "profile_name", None) or None)


def masked_credentials(creds: AwsLikeCredentials | None) -> str | None:
    """A repr of a credentials block without its key id or session token (prefect-aws keeps
    both as plain strings): its type, document name, region and endpoint."""
    if creds is None:
        return None
    params = getattr(creds, "aws_client_parameters", None)
    name = getattr(creds, "_block_document_name", None)
    parts = ([repr(name)] if name else []) + [
        f"region_name={getattr(creds, 'region_name', None)!r}",
        f"endpoint_url={getattr(params, 'endpoint_url', None)!r}"]
    return f"{type(creds).__name__}({', '.join(parts)})"


class _Shown:
    """A value shown in a repr as the given text."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def __repr__(self) -> str:
        return str(self.text)


def masked_repr_args(args: list[tuple[str | None, Any]]) -> list[tuple[str | None, Any]]:
    """A block's repr arguments with its nested `aws_credentials` shown without keys."""
    return [(k, _Shown(masked_credentials(v)) if k == "aws_credentials" else v) for k, v in args]
