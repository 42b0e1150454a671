"""prefect-aws blocks as a run's store and reward credentials (blocks/aws.py): S3Bucket and
AwsCredentials -> the run's storage settings and its secret environment, LambdaFunction -> the
reward settings; secrets never in the overrides or a repr. No Prefect server: block loading is
stubbed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefect_aws import AwsCredentials, LambdaFunction, S3Bucket
from prefect_aws.client_parameters import AwsClientParameters
from prefect_aws.credentials import MinIOCredentials

from blocks import LambdaRewards, ResolvedBlocks, RunStorage, load_block
from blocks.aws import credential_fields
from rollart.config import load_config

ROOT = Path(__file__).resolve().parents[2]
KEY, SECRET, TOKEN = "AKIDPREFECTAWS", "s3cr3t-prefect-aws", "session-token-value"
SECRETS = (KEY, SECRET, TOKEN)


def _creds(endpoint: str | None = "http://127.0.0.1:8333", **kw: Any) -> AwsCredentials:
    return AwsCredentials(aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                          aws_session_token=TOKEN, region_name="eu-west-1",
                          aws_client_parameters=AwsClientParameters(endpoint_url=endpoint), **kw)


def _cfg(overrides: list[str]) -> Any:
    return load_config(ROOT / "configs/default.yaml", overrides)


def _no_secret(*texts: str) -> None:
    for text in texts:
        for s in SECRETS:
            assert s not in text, f"{s!r} leaked into {text[:200]!r}"


def test_s3_bucket_maps_to_the_run_store_and_its_secret_environment():
    bucket = S3Bucket(bucket_name="runs", bucket_folder="team/a/", credentials=_creds())
    storage = RunStorage.from_s3_bucket(bucket)
    overrides = storage.config_overrides()
    cfg = _cfg(overrides)
    assert cfg.storage.root == "s3://runs/team/a"
    assert cfg.storage.endpoint_url == "http://127.0.0.1:8333"
    assert cfg.storage.region == "eu-west-1" and cfg.storage.profile is None
    assert storage.environment() == {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                                     "AWS_SESSION_TOKEN": TOKEN}
    found = ResolvedBlocks()
    found.add(storage, "s3-bucket", "runs")
    assert found.storage is storage and found.env == storage.environment()
    _no_secret(json.dumps(overrides), cfg.model_dump_json(), repr(storage), str(storage),
               repr(found), repr(credential_fields(_creds())))
    assert "AwsCredentials(" in repr(storage) and "eu-west-1" in repr(storage)


def test_s3_bucket_without_folder_or_endpoint_is_aws_s3():
    storage = RunStorage.from_s3_bucket(S3Bucket(bucket_name="bkt", credentials=_creds(None)))
    cfg = _cfg(storage.config_overrides())
    assert cfg.storage.root == "s3://bkt" and cfg.storage.endpoint_url is None


def test_s3_bucket_with_minio_credentials():
    minio = MinIOCredentials(minio_root_user=KEY, minio_root_password=SECRET,
                             aws_client_parameters=AwsClientParameters(
                                 endpoint_url="http://127.0.0.1:9000"))
    storage = RunStorage.from_s3_bucket(S3Bucket(bucket_name="minio-b", credentials=minio))
    cfg = _cfg(storage.config_overrides())
    assert cfg.storage.root == "s3://minio-b" and cfg.storage.endpoint_url == "http://127.0.0.1:9000"
    assert cfg.storage.region == "us-east-1"
    assert storage.environment() == {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    _no_secret(repr(storage), json.dumps(storage.config_overrides()))


def test_run_storage_fields_win_over_its_credentials_block():
    storage = RunStorage(bucket="bkt", endpoint_url="http://127.0.0.1:1", region="ap-south-1",
                         access_key_id="OWNKEY", secret_access_key="own-secret",
                         aws_credentials=_creds())
    cfg = _cfg(storage.config_overrides())
    assert (cfg.storage.endpoint_url, cfg.storage.region) == ("http://127.0.0.1:1", "ap-south-1")
    assert storage.environment() == {"AWS_ACCESS_KEY_ID": "OWNKEY",
                                     "AWS_SECRET_ACCESS_KEY": "own-secret"}
    assert RunStorage(root="/tmp/x", aws_credentials=_creds()).environment() == {}


def test_profile_credentials_set_the_storage_profile():
    storage = RunStorage(bucket="bkt", aws_credentials=AwsCredentials(profile_name="research"))
    cfg = _cfg(storage.config_overrides())
    assert cfg.storage.profile == "research" and storage.environment() == {}


def test_assumed_roles_are_refused():
    with pytest.raises(ValueError, match="assume_role_arn"):
        RunStorage(bucket="bkt", aws_credentials=_creds(
            assume_role_arn="arn:aws:iam::1:role/r")).environment()


def test_lambda_function_maps_to_reward_settings_on_aws():
    fn = LambdaFunction(function_name="scorer", qualifier="prod", aws_credentials=_creds(None))
    rewards = LambdaRewards.from_lambda_function(fn, max_concurrency=8)
    cfg = _cfg(rewards.config_overrides())
    assert cfg.reward.function_name == "scorer" and cfg.reward.alias == "prod"
    assert cfg.reward.region == "eu-west-1" and cfg.reward.endpoint_url is None
    assert not cfg.reward.embedded_endpoint and cfg.reward.max_concurrency == 8
    assert rewards.environment()["AWS_SECRET_ACCESS_KEY"] == SECRET
    _no_secret(repr(rewards), json.dumps(rewards.config_overrides()), cfg.model_dump_json())


def test_aws_credentials_for_the_local_lambda_endpoint():
    rewards = LambdaRewards(embedded_endpoint=True,
                            aws_credentials=_creds("http://127.0.0.1:9001"))
    cfg = _cfg(rewards.config_overrides())
    assert cfg.reward.endpoint_url == "http://127.0.0.1:9001" and not cfg.reward.embedded_endpoint
    assert rewards.environment() == {"ROLLART_LAMBDA_ACCESS_KEY_ID": KEY,
                                     "ROLLART_LAMBDA_SECRET_ACCESS_KEY": SECRET}


def test_blocks_with_two_key_pairs_are_refused():
    found = ResolvedBlocks()
    found.add(LambdaRewards(aws_access_key_id="OTHER", aws_secret_access_key="other-secret"),
              "rollart-lambda-rewards", "aws")
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY") as err:
        found.add(RunStorage.from_s3_bucket(S3Bucket(bucket_name="b", credentials=_creds())),
                  "s3-bucket", "b")
    _no_secret(str(err.value))
    assert "other-secret" not in str(err.value)


def _stub_load(monkeypatch: pytest.MonkeyPatch, docs: dict[tuple[type, str], Any]) -> None:
    def loader(cls: type) -> Any:
        def load(name: str) -> Any:
            if (cls, name) not in docs:
                raise ValueError(f"Unable to find block document named {name} for block type x")
            return docs[cls, name]
        return load

    for cls in (RunStorage, S3Bucket, LambdaRewards, LambdaFunction):
        monkeypatch.setattr(cls, "load", loader(cls))


def test_block_names_pick_our_type_then_prefect_aws(monkeypatch):
    ours = RunStorage(root="/tmp/ours")
    theirs = S3Bucket(bucket_name="theirs", credentials=_creds())
    _stub_load(monkeypatch, {(RunStorage, "local"): ours, (S3Bucket, "local"): theirs,
                             (S3Bucket, "only-s3"): theirs,
                             (LambdaFunction, "fn"): LambdaFunction(function_name="f")})
    assert load_block("storage", "local") == (ours, "rollart-storage")
    block, slug = load_block("storage", "s3-bucket/local")
    assert slug == "s3-bucket" and block.store_root() == "s3://theirs"
    assert load_block("storage", "only-s3")[0].bucket == "theirs"
    rewards, slug = load_block("rewards", "fn")
    assert isinstance(rewards, LambdaRewards) and slug == "lambda-function"
    with pytest.raises(ValueError, match="no rollart-storage or s3-bucket block named 'nope'"):
        load_block("storage", "nope")
    with pytest.raises(ValueError, match="accepted types: rollart-storage, s3-bucket"):
        load_block("storage", "aws-credentials/local")
