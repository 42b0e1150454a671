"""Prefect Secret blocks as the source of S3 credentials (`storage.credentials_block`).

The core library reads secrets only through a resolver installed explicitly in each process
that opens the store (`rollart.storage.s3.install_credentials_resolver`): the flows call
`install_credentials_resolver()` in the flow process and register `CredentialsResolverPlugin`
on the Dask cluster, so every worker (also one that joins later) resolves blocks itself.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from rollart.storage import s3


def load_secret_value(name: str) -> Any:
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name, _sync=True).get()  # type: ignore[call-arg]
    except ValueError as err:
        raise s3.StorageError(
            f"storage: Prefect Secret block {name!r} not found (create it with "
            "`Secret(value={'aws_access_key_id': ..., 'aws_secret_access_key': ...}).save(...)`)"
        ) from err


def install_credentials_resolver() -> None:
    """Prefect Secret blocks resolve `storage.credentials_block` in this process."""
    s3.install_credentials_resolver(load_secret_value)


class CredentialsResolverPlugin(WorkerPlugin):
    """Installs the Prefect Secret resolver on every Dask worker of the run."""

    name = "rollart-credentials-resolver"

    def setup(self, worker: Any) -> None:
        install_credentials_resolver()
