"""Prefect Secret blocks as the source of S3 credentials (`storage.credentials_block`).

The name may also be a prefect-aws `AwsCredentials` block (type slug `aws-credentials`), the
block Prefect users already keep their AWS keys in (its key pair and session token; its region
and endpoint are the config's, `storage.region` / `storage.endpoint_url`). A Secret of that
name wins.

The core library reads secrets only through a resolver installed explicitly in each process
that opens the store (`rollart.storage.s3.install_credentials_resolver`): the flows call
`install_credentials_resolver()` in the flow process and register `CredentialsResolverPlugin`
on the Dask cluster, so every worker (also one that joins later) resolves blocks itself.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from rollart.storage import s3


def _aws_credentials_block(name: str) -> dict[str, Any] | None:
    """The key fields of the prefect-aws `AwsCredentials` block `name`, or None."""
    from blocks.aws import AwsCredentials, credential_fields

    try:
        creds = AwsCredentials.load(name, _sync=True)  # type: ignore[call-arg]
    except ValueError:
        return None
    try:
        fields = credential_fields(creds)
    except ValueError as err:
        raise s3.StorageError(f"storage: AwsCredentials block {name!r}: {err}") from None
    return {"aws_access_key_id": fields.access_key_id,
            "aws_secret_access_key": fields.secret_access_key,
            "aws_session_token": fields.session_token}


def load_secret_value(name: str) -> Any:
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name, _sync=True).get()  # type: ignore[call-arg]
    except ValueError as err:
        creds = _aws_credentials_block(name)
        if creds is not None:
            return creds
        raise s3.StorageError(
            f"storage: no Prefect Secret or AwsCredentials block {name!r} (create one with "
            "`Secret(value={'aws_access_key_id': ..., 'aws_secret_access_key': ...}).save(...)`"
            " or prefect-aws's `AwsCredentials(...).save(...)`)"
        ) from err


def install_credentials_resolver() -> None:
    """Prefect Secret blocks resolve `storage.credentials_block` in this process."""
    s3.install_credentials_resolver(load_secret_value)


class CredentialsResolverPlugin(WorkerPlugin):
    """Installs the Prefect Secret resolver on every Dask worker of the run."""

    name = "rollart-credentials-resolver"

    def setup(self, worker: Any) -> None:
        install_credentials_resolver()
