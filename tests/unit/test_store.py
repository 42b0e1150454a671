"""Run store on a local directory: shards, checkpoints (manifest last, torn/corrupt ignored,
retention), weight versions, background writer, retry classification, storage config."""

import errno
import json
import threading
import time

import pytest
import torch

from rollart.config import ConfigError, StorageConfig, load_config
from rollart.storage.background import BackgroundError, BackgroundWriter
from rollart.storage.s3 import StorageError, is_transient, retrying, storage_options
from rollart.storage.store import RunStore
from rollart.storage.weights import (
    latest_weights_version,
    load_weights,
    prune_weights,
    publish_weights,
    retie,
    serialize_weights,
)


def test_shard_roundtrip(tmp_path, make_traj):
    store = RunStore(str(tmp_path), "r1")
    trajs = [make_traj(i, env_return=float(i)) for i in range(3)]
    store.write_shard(4, trajs)
    store.write_shard(5, trajs[:1])
    back = store.read_shards(4)
    assert [t.sample_id for t in back] == ["s0", "s1", "s2"]
    assert back[2].env_return == 2.0 and back[0].turns[0].action == "Left"
    assert back[0].reward_details == {"success": 1.0}
    assert back[0].behaviour_logprobs == [0.0, -1.0, -2.0]
    assert store.shard_steps() == [4, 5]
    table = store.read_shard_table()  # every step, one Arrow table for analysis
    assert table.num_rows == 4 and table.column("sample_id").to_pylist()[-1] == "s0"
    assert store.read_shard_table(9).num_rows == 0


def test_checkpoint_manifest_last_and_torn_ignored(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    store.save_checkpoint(1, {"a.bin": b"x" * 10}, {"note": "first"})
    store.save_checkpoint(2, {"a.bin": b"y" * 10, "b.bin": b"b"}, {})
    # A torn checkpoint: files but no manifest, and one whose file is shorter than listed.
    store.write_bytes("checkpoints/00000003/a.bin", b"z")
    store.save_checkpoint(4, {"a.bin": b"w" * 10}, {})
    store.write_bytes("checkpoints/00000004/a.bin", b"w")  # truncated after the manifest
    assert store.list_checkpoints() == [1, 2]
    assert store.latest_checkpoint() == 2
    files, manifest = store.load_checkpoint(1)
    assert files == {"a.bin": b"x" * 10} and manifest["note"] == "first"
    assert manifest["files"]["a.bin"]["bytes"] == 10 and "crc32" in manifest["files"]["a.bin"]
    assert store.load_checkpoint(2, only=["b.bin"])[0] == {"b.bin": b"b"}
    removed = store.prune_checkpoints(keep_last=1)
    assert removed == [1]  # torn 3 and 4 are newer than the newest complete one: kept
    assert store.list_checkpoints() == [2] and store.checkpoint_steps() == [2, 3, 4]


def test_corrupt_checkpoint_detected_by_crc(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    store.save_checkpoint(1, {"a.bin": b"x" * 10}, {})
    store.write_bytes("checkpoints/00000001/a.bin", b"X" * 10)  # same size, other bytes
    with pytest.raises(StorageError, match="corrupt"):
        store.load_checkpoint(1)


def test_rewriting_a_step_drops_its_manifest_first(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path), "r1")
    store.save_checkpoint(1, {"a.bin": b"old"}, {})
    real = store.write_many

    def crash(files):
        raise RuntimeError("killed mid-upload")

    monkeypatch.setattr(store, "write_many", crash)
    with pytest.raises(RuntimeError):
        store.save_checkpoint(1, {"a.bin": b"new!", "b.bin": b"b"}, {})
    monkeypatch.setattr(store, "write_many", real)
    assert store.list_checkpoints() == []  # the old manifest is gone: no mixed checkpoint


def test_metrics_jsonl_append(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    store.append_jsonl("metrics.jsonl", {"a": 1})
    store.append_jsonl("metrics.jsonl", {"a": 2})
    assert [r["a"] for r in store.read_jsonl("metrics.jsonl")] == [1, 2]
    assert json.loads(store.read_text("metrics.jsonl").splitlines()[0]) == {"a": 1}


def test_weight_versions_publish_load_prune(tmp_path):
    store = RunStore(str(tmp_path), "r1")
    emb = torch.randn(5, 4)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(4)}  # tied
    for v in (1, 2, 3):
        rec = publish_weights(store, v, serialize_weights(state), {"step": v})
        assert rec["bytes"] > 0 and rec["path"].endswith(f"weights/v{v}")
    store.write_bytes("weights/v4/model.safetensors", b"partial")  # no manifest: not published
    assert latest_weights_version(store) == 3
    loaded = load_weights(store, 2)
    assert set(loaded) == {"embed.weight", "norm.weight"}  # tied tensor stored once

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.lm_head = torch.nn.Linear(4, 5, bias=False)
            self.lm_head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(4, bias=False)

    full = retie(loaded, Tied())
    assert torch.equal(full["lm_head.weight"], emb)
    assert prune_weights(store, keep_last=1) == [1, 2]
    with pytest.raises(StorageError, match="not published"):
        load_weights(store, 1)


def test_background_writer_order_errors_and_backpressure():
    w = BackgroundWriter("test", max_pending=1)
    seen: list[int] = []
    gate = threading.Event()
    w.submit("a", lambda: (gate.wait(5), seen.append(1)))
    threading.Timer(0.3, gate.set).start()
    waited = w.submit("b", lambda: seen.append(2))  # must wait for "a" (max_pending=1)
    assert waited >= 0.2
    assert [r["label"] for r in w.drain()] == ["a", "b"] and seen == [1, 2]
    w.submit("boom", lambda: 1 / 0)
    with pytest.raises(BackgroundError, match="boom"):
        w.drain()
    w.close()


def test_transient_error_classification():
    assert is_transient(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert is_transient(OSError(errno.EBUSY, "SlowDown"))
    assert is_transient(TimeoutError())
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert not is_transient(PermissionError("SignatureDoesNotMatch"))
    assert not is_transient(FileNotFoundError("nope"))
    assert not is_transient(NoCredentialsError())


def test_retrying_waits_out_an_outage_but_not_a_permanent_error():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 4:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        return "ok"

    assert retrying(flaky, "flaky op", timeout_s=10, base_s=0.01) == "ok" and calls["n"] == 4
    t0 = time.monotonic()
    with pytest.raises(PermissionError):
        retrying(lambda: (_ for _ in ()).throw(PermissionError("denied")), "x", timeout_s=10)
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(StorageError, match="still failing"):
        retrying(lambda: (_ for _ in ()).throw(TimeoutError()), "down", timeout_s=0.3,
                 base_s=0.05)


@pytest.mark.parametrize("overrides, fragment", [
    (["storage.root=s3://Bad_Bucket/x"], "bucket name"),
    (["storage.endpoint_url=http://127.0.0.1:9000"], "s3:// roots only"),
    (["storage.root=s3://ok-bucket/p", "storage.endpoint_url=localhost:9000"], "http(s)://"),
    (["storage.root=s3://ok-bucket/p", "storage.credentials_block=AKIA/SECRET+KEY"],
     "never the secret"),
    (["storage.keep_last=0"], "keep_last"),
    (["storage.aws_secret_access_key=x"], "unknown config key"),
])
def test_storage_config_errors(overrides, fragment):
    with pytest.raises(ConfigError, match="storage") as err:
        load_config(None, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_storage_options_s3_endpoint_region_and_no_listing_cache():
    assert storage_options(StorageConfig(root="/tmp/x")) == {}
    opts = storage_options(StorageConfig(root="s3://bkt/p", endpoint_url="http://127.0.0.1:1/",
                                         region="eu-west-1"))
    assert opts["endpoint_url"] == "http://127.0.0.1:1"
    assert opts["client_kwargs"] == {"region_name": "eu-west-1"}
    assert opts["use_listings_cache"] is False and "key" not in opts and "secret" not in opts
