"""The run store against a real S3 server: SeaweedFS `weed mini` on loopback, auth enforced."""

import os
import threading
import time

import pytest
import torch

from infra.seaweed import start_seaweed
from rollart.config import StorageConfig
from rollart.storage.blob import ALIGN, ChunkedBytes
from rollart.storage.s3 import StorageError, check_storage
from rollart.storage.store import RunStore
from rollart.storage.weights import latest_weights_version, load_weights_bytes, publish_weights

pytestmark = pytest.mark.integration

KEY, SECRET = "rollart-test", "rollart-test-secret"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"), access_key=KEY, secret_key=SECRET)
    yield server
    server.stop()


@pytest.fixture
def aws_env(s3, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return s3


def _cfg(s3, prefix: str, **kw) -> StorageConfig:
    return StorageConfig(root=f"s3://{s3.bucket}/{prefix}", endpoint_url=s3.endpoint_url, **kw)


def _traj(i: int):
    from rollart.types import Trajectory

    return Trajectory(sample_id=f"s{i}", task="t", env_id="e", group_id="g", seed=i, iteration=3,
                      token_ids=[1, 2], loss_mask=[0, 1], behaviour_logprobs=[0.0, -0.5],
                      token_versions=[-1, 2], reward=float(i))


def test_shards_checkpoints_and_weights_round_trip(aws_env):
    assert check_storage(_cfg(aws_env, "rt")).startswith("S3 s3://")
    store = RunStore.from_config(_cfg(aws_env, "rt"), "run1")
    assert store.url == f"s3://{aws_env.bucket}/rt/runs/run1"
    store.write_shard(3, [_traj(i) for i in range(4)])
    back = store.read_shards(3)
    assert [t.sample_id for t in back] == ["s0", "s1", "s2", "s3"] and back[2].reward == 2.0
    assert store.shard_steps() == [3]

    big = os.urandom(20 * 2**20)  # multipart (several 8 MiB parts, uploaded concurrently)
    for step in (1, 2, 3):
        store.save_checkpoint(step, {"model.bin": big, "rng.bin": b"r" * step},
                              {"iteration": step - 1})
    store.write_bytes("checkpoints/00000004/model.bin", b"torn")  # no manifest
    assert store.list_checkpoints() == [1, 2, 3] and store.latest_checkpoint() == 3
    files, manifest = store.load_checkpoint(2)
    assert files["model.bin"] == big and files["rng.bin"] == b"rr"
    assert manifest["iteration"] == 1 and manifest["bytes"] == len(big) + 2
    assert store.prune_checkpoints(keep_last=2) == [1]
    assert store.list_checkpoints() == [2, 3] and 4 in store.checkpoint_steps()

    publish_weights(store, 5, b"weights-v5")
    assert latest_weights_version(store) == 5
    assert load_weights_bytes(store, 5)[0] == b"weights-v5"
    # A second reader opened from the same config reaches the same objects (no process-global
    # options: a plain RunStore(root) would use fsspec's defaults).
    assert RunStore.from_config(_cfg(aws_env, "rt"), "run1").read_shards(3)[0].sample_id == "s0"

    # A trainer's tensor files (ChunkedBytes, 3 MiB chunks: the parts cut across them), and
    # one under two parts (a single PUT, as bytes).
    chunked = ChunkedBytes(len(big), 3 * 2**20)
    chunked.write_at(0, torch.frombuffer(bytearray(big), dtype=torch.uint8))
    small = ChunkedBytes(5, ALIGN)
    small.write_at(0, torch.tensor(list(b"small"), dtype=torch.uint8))
    other = RunStore.from_config(_cfg(aws_env, "rt"), "run-chunked")
    other.save_checkpoint(5, {"model.bin": chunked, "s.bin": small}, {"iteration": 4})
    files, _ = other.load_checkpoint(5)
    assert files == {"model.bin": big, "s.bin": b"small"}


def test_server_restart_mid_run_is_retried(aws_env):
    store = RunStore.from_config(_cfg(aws_env, "restart"), "run1")
    store.write_text("before.txt", "kept")
    bounced = threading.Event()

    def crash_and_restart():
        time.sleep(0.3)
        aws_env.restart(kill=True, down_s=2.0)  # SIGKILL, 2 s down, same ports and data
        bounced.set()

    th = threading.Thread(target=crash_and_restart)
    th.start()
    t0 = time.monotonic()
    for step in range(1, 40):
        store.save_checkpoint(step, {"a.bin": os.urandom(2 * 2**20), "b.txt": b"b"}, {})
        if bounced.is_set() and time.monotonic() - t0 > 3:
            break
        time.sleep(0.05)
    th.join()
    assert bounced.is_set()
    done = store.list_checkpoints()
    assert done == list(range(1, step + 1))  # every save succeeded despite the outage
    assert store.read_text("before.txt") == "kept"  # data survived the crash


def test_wrong_credentials_fail_fast_with_one_line(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        check_storage(_cfg(aws_env, "bad"))
    msg = str(err.value)
    assert "rejected the credentials" in msg and "AWS_SECRET_ACCESS_KEY" in msg
    assert "\n" not in msg and time.monotonic() - t0 < 5  # permanent: no retry loop


def test_missing_bucket_and_unreachable_endpoint(aws_env):
    cfg = StorageConfig(root="s3://no-such-bucket/p", endpoint_url=aws_env.endpoint_url)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist.*create_bucket"):
        check_storage(cfg)
    made = StorageConfig(root="s3://made-on-demand/p", endpoint_url=aws_env.endpoint_url,
                         create_bucket=True)
    check_storage(made)
    RunStore.from_config(made, "r").write_text("ok", "1")
    dead = StorageConfig(root="s3://rollart/p", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(StorageError, match="still failing.*127.0.0.1:9"):
        check_storage(dead, timeout_s=1.0)


def test_credentials_from_a_prefect_secret_block(aws_env, prefect_api, monkeypatch):
    from prefect.blocks.system import Secret

    from blocks.secrets import install_credentials_resolver
    from rollart.storage import s3

    Secret(value={"aws_access_key_id": KEY, "aws_secret_access_key": SECRET}).save(
        "rollart-s3-test", overwrite=True)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    cfg = _cfg(aws_env, "block", credentials_block="rollart-s3-test")
    assert "secret" not in cfg.model_dump_json().lower().replace("credentials_block", "")
    s3.install_credentials_resolver(None)  # nothing installed: a clear error, not a guess
    with pytest.raises(StorageError, match="needs a credentials resolver"):
        check_storage(cfg)
    install_credentials_resolver()  # what the flows do, in their process and on each worker
    check_storage(cfg)
    RunStore.from_config(cfg, "r").write_text("via-block", "1")
    with pytest.raises(StorageError, match="no-such-block"):
        check_storage(_cfg(aws_env, "block", credentials_block="no-such-block"))


def test_credentials_from_an_aws_credentials_block(aws_env, prefect_api, monkeypatch):
    """prefect-aws's AwsCredentials block as `storage.credentials_block`."""
    from prefect_aws import AwsCredentials
    from pydantic import SecretStr

    from blocks.secrets import install_credentials_resolver

    AwsCredentials(aws_access_key_id=KEY, aws_secret_access_key=SecretStr(SECRET)).save(
        "rollart-aws-test", overwrite=True)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    install_credentials_resolver()
    cfg = _cfg(aws_env, "awsblock", credentials_block="rollart-aws-test")
    check_storage(cfg)
    RunStore.from_config(cfg, "r").write_text("via-aws-block", "1")
    AwsCredentials(aws_access_key_id=KEY, aws_secret_access_key=SecretStr("wrong")).save(
        "rollart-aws-wrong", overwrite=True)
    with pytest.raises(StorageError, match="rejected the credentials"):
        check_storage(_cfg(aws_env, "awsblock", credentials_block="rollart-aws-wrong"))


def test_run_store_from_prefect_aws_blocks(aws_env, prefect_api, monkeypatch):
    """The stack's S3 server as prefect-aws blocks (what `rollart up` and `rollart deploy`
    save): `s3-bucket/NAME` as a flow's storage block, and a RunStorage that references the
    AwsCredentials document. The keys reach the store through the environment only."""
    import json

    from prefect import get_client

    from blocks import RunStorage, resolve_blocks
    from blocks.registration import register_s3_blocks
    from rollart.config import load_config

    creds, saved = register_s3_blocks({"bucket": aws_env.bucket, "prefix": "pa",
                                       "endpoint_url": aws_env.endpoint_url,
                                       "access_key_id": KEY, "secret_access_key": SECRET})
    assert saved == ["aws-credentials/local-s3", "s3-bucket/local"]
    RunStorage(bucket=aws_env.bucket, prefix="ours", aws_credentials=creds).save(
        "rollart-pa-test", overwrite=True)
    with get_client(sync_client=True) as client:  # the API shows the secret masked
        doc = client.read_block_document_by_name("local-s3", "aws-credentials",
                                                 include_secrets=False)
        ours = client.read_block_document_by_name("rollart-pa-test", "rollart-storage",
                                                  include_secrets=False)
    assert SECRET not in json.dumps(doc.data, default=str) + json.dumps(ours.data, default=str)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    for name, root in (("s3-bucket/local", "pa"), ("rollart-pa-test", "ours")):
        found = resolve_blocks(storage=name)
        cfg = load_config(None, found.overrides).storage
        assert cfg.root == f"s3://{aws_env.bucket}/{root}"
        assert cfg.endpoint_url == aws_env.endpoint_url and cfg.region == "us-east-1"
        assert SECRET not in json.dumps(found.overrides) + repr(found) + cfg.model_dump_json()
        assert found.env == {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
        for k, v in found.env.items():
            monkeypatch.setenv(k, v)
        check_storage(cfg)
        RunStore.from_config(cfg, "r").write_text("via-prefect-aws", "1")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")


def test_local_block_documents_reference_prefect_aws_credentials(aws_env, prefect_api):
    """`rollart deploy`'s documents: the `local` store and rewards hold no key of their own but
    reference aws-credentials/local-s3 and local-lambda; saving twice (a second deploy) keeps
    the references valid."""
    from blocks import resolve_blocks
    from blocks.registration import register_local_blocks
    from rollart.config import load_config
    from rollart.rewards.client import LambdaCredentials

    s3 = {"bucket": aws_env.bucket, "endpoint_url": aws_env.endpoint_url,
          "access_key_id": KEY, "secret_access_key": SECRET}
    stack = {"lambda_url": "http://127.0.0.1:9001", "scheduler_address": "tcp://127.0.0.1:1"}
    for _ in range(2):
        saved = register_local_blocks(stack, s3=s3,
                                      lambda_credentials=LambdaCredentials("lk", "lambda-secret"))
    assert {"aws-credentials/local-s3", "aws-credentials/local-lambda", "s3-bucket/local",
            "rollart-storage/local", "rollart-lambda-rewards/local"} <= set(saved)
    found = resolve_blocks(storage="local", rewards="local")
    assert found.env == {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                         "ROLLART_LAMBDA_ACCESS_KEY_ID": "lk",
                         "ROLLART_LAMBDA_SECRET_ACCESS_KEY": "lambda-secret"}
    cfg = load_config(None, found.overrides)
    assert cfg.storage.root == f"s3://{aws_env.bucket}"
    assert cfg.storage.endpoint_url == aws_env.endpoint_url
    assert cfg.reward.endpoint_url == "http://127.0.0.1:9001"
    assert SECRET not in repr(found) and "lambda-secret" not in repr(found)


def test_blocks_migrate_moves_keys_into_aws_credentials(prefect_api):
    """Documents of our types that hold keys of their own resolve the same after
    `rollart blocks migrate` moved the keys into AwsCredentials documents they reference."""
    from blocks import LambdaRewards, RunStorage, resolve_blocks
    from blocks.migrate import migrate_documents

    RunStorage(bucket="old-bucket", endpoint_url="http://127.0.0.1:8333",
               access_key_id=KEY, secret_access_key=SECRET).save("old-style", overwrite=True)
    LambdaRewards(endpoint_url="http://127.0.0.1:9001", aws_access_key_id="lk",
                  aws_secret_access_key="lambda-secret").save("old-style", overwrite=True)
    before = resolve_blocks(storage="old-style", rewards="old-style")
    plan = migrate_documents(dry_run=True)
    assert "rollart-storage/old-style: keys would move to aws-credentials/old-style-s3" in plan
    assert RunStorage.load("old-style").access_key_id is not None
    done = migrate_documents()
    assert "rollart-lambda-rewards/old-style: keys moved to aws-credentials/old-style-lambda" \
        in done and SECRET not in "".join(done)
    storage = RunStorage.load("old-style")
    assert storage.access_key_id is None and storage.aws_credentials is not None
    after = resolve_blocks(storage="old-style", rewards="old-style")
    assert (after.overrides, after.env) == (before.overrides, before.env)
    assert not any("old-style" in line for line in migrate_documents())  # nothing left
