"""Prefect Secret blocks as the source of S3 credentials (`storage.credentials_block`).

Importing this module registers the resolver with `rollart.storage.s3`, which calls it lazily
on whichever process opens the store; the core library never imports Prefect itself.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.system import Secret

from rollart.storage import s3


def load_secret_value(name: str) -> Any:
    try:
        return Secret.load(name, _sync=True).get()  # type: ignore[call-arg]
    except ValueError as err:
        raise s3.StorageError(
            f"storage: Prefect Secret block {name!r} not found (create it with "
            "`Secret(value={'aws_access_key_id': ..., 'aws_secret_access_key': ...}).save(...)`)"
        ) from err


if load_secret_value not in s3.CREDENTIAL_RESOLVERS:
    s3.CREDENTIAL_RESOLVERS.append(load_secret_value)
