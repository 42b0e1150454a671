"""`rollart blocks migrate`: move the keys of existing RunStorage and LambdaRewards documents
into prefect-aws AwsCredentials documents that they then reference.

Documents with their own key fields keep working as they are; migrating puts the keys where
Prefect users (and prefect-aws's own blocks and tasks) look for them, one AwsCredentials per
document: `NAME-s3` for a storage document, `NAME-lambda` for a rewards document. An existing
AwsCredentials of that name is never overwritten (the document is skipped and says so).
"""

from __future__ import annotations

from typing import Any

from prefect_aws.client_parameters import AwsClientParameters

from blocks import LambdaRewards, RunStorage, register_block_types
from blocks.aws import AwsCredentials

SUFFIX = {RunStorage: "s3", LambdaRewards: "lambda"}


def _document_names(slug: str) -> list[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        docs = client.read_block_documents_by_type(slug, include_secrets=False)
    return sorted(d.name for d in docs if d.name and not d.is_anonymous)


def _keys(block: Any) -> tuple[str, str] | None:
    if isinstance(block, RunStorage):
        key, secret = block.access_key_id, block.secret_access_key
    else:
        key, secret = block.aws_access_key_id, block.aws_secret_access_key
    if block.aws_credentials is not None or not (key and secret):
        return None
    return key.get_secret_value(), secret.get_secret_value()


def _exists(name: str) -> bool:
    try:
        AwsCredentials.load(name)
    except ValueError:
        return False
    return True


def migrate_documents(dry_run: bool = False) -> list[str]:
    """Migrate every RunStorage and LambdaRewards document that holds its own key pair. Returns
    one line per document considered (never a key)."""
    register_block_types()
    lines: list[str] = []
    for cls, suffix in SUFFIX.items():
        slug = cls.get_block_type_slug()
        for name in _document_names(slug):
            block: Any = cls.load(name)
            keys = _keys(block)
            if keys is None:
                continue
            target = f"{name}-{suffix}"
            if _exists(target):
                lines.append(f"{slug}/{name}: skipped, aws-credentials/{target} exists")
                continue
            lines.append(f"{slug}/{name}: keys {'would move' if dry_run else 'moved'} to "
                         f"aws-credentials/{target}")
            if dry_run:
                continue
            creds = AwsCredentials(
                aws_access_key_id=keys[0], aws_secret_access_key=keys[1],
                region_name=block.region,
                aws_client_parameters=AwsClientParameters(endpoint_url=block.endpoint_url))
            creds.save(target)
            if isinstance(block, RunStorage):
                block.access_key_id = block.secret_access_key = None
            else:
                block.aws_access_key_id = block.aws_secret_access_key = None
            block.aws_credentials = creds
            block.save(name, overwrite=True)
    return lines
