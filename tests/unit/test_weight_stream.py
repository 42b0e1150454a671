"""The cross-host weight stream (rollart/engines/weight_stream.py) on loopback, in threads: exact
bytes through chains of 1-3 receivers, authentication, a hop dying or stalling mid-stream,
malformed headers refused before anything is allocated."""

from __future__ import annotations

import json
import secrets
import socket
import struct
import threading
import time

import pytest
import torch

from rollart.engines import weight_stream
from rollart.engines import weight_stream_proto as proto
from rollart.engines.weight_stream import (
    TensorMeta,
    WeightReceiver,
    WeightStreamError,
    plan_buckets,
    send_weights,
)

HOST = "127.0.0.1"
TOKEN = secrets.token_bytes(32)
CHUNK = 16 << 10  # small chunks: a tensor spans several, several tensors per bucket


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g)
    return {
        "embed.weight": w,
        "lm_head.weight": w,  # tied: sent under each name
        "layer.0.bf16": torch.randn(33, 65, generator=g).to(torch.bfloat16),
        "layer.0.ids": torch.randint(-(1 << 62), 1 << 62, (1000,), generator=g),
        "empty": torch.empty(0, 7),
        "scalar.bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "norm": torch.randn(80, generator=g),
    }


def _check(rx: WeightReceiver, state: dict[str, torch.Tensor], version: int) -> None:
    got_version, tensors, stats = rx.result(timeout=10)
    assert got_version == version
    assert list(tensors) == list(state)
    for name, t in state.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape, name
        assert torch.equal(tensors[name], t), name
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_chain_delivers_exact_tensors_bucket_by_bucket(n: int) -> None:
    state = _state()
    metas = [TensorMeta.of(k, v) for k, v in state.items()]
    asked: list[list[str]] = []

    def gather(bucket: list[TensorMeta]) -> list[torch.Tensor]:  # a sharded trainer's gather
        asked.append([m.name for m in bucket])
        return [state[m.name].clone() for m in bucket]

    rxs = [WeightReceiver(HOST, TOKEN, timeout_s=5) for _ in range(n)]
    try:
        out = send_weights([r.address for r in rxs], TOKEN, 12, gather, meta=metas,
                           bucket_bytes=32 << 10, chunk_bytes=CHUNK, timeout_s=5)
        assert len(asked) >= 3 and sum(asked, []) == list(state)
        assert [h["addr"] for h in out["hops"]] == [f"{h}:{p}" for h, p in
                                                   (r.address for r in rxs)]
        for rx in rxs:
            _check(rx, state, 12)
    finally:
        for rx in rxs:
            rx.close()


def test_star_and_iterator_forms() -> None:
    state = _state()
    rxs = [WeightReceiver(HOST, TOKEN, timeout_s=5) for _ in range(2)]
    try:
        send_weights([r.address for r in rxs], TOKEN, 3, state, mode="star", chunk_bytes=CHUNK)
        for rx in rxs:
            _check(rx, state, 3)
    finally:
        for rx in rxs:
            rx.close()
    metas = [TensorMeta.of(k, v) for k, v in state.items()]
    with pytest.raises(ValueError, match="one-shot"):
        send_weights([(HOST, 1), (HOST, 2)], TOKEN, 3, iter(state.values()), meta=metas,
                     mode="star")
    with WeightReceiver(HOST, TOKEN, timeout_s=5) as rx:  # values one by one, in meta order
        send_weights([rx.address], TOKEN, 4, iter(state.values()), meta=metas)
        _check(rx, state, 4)


def test_receiver_reuses_the_previous_buffers_when_they_fit() -> None:
    state = _state()
    with WeightReceiver(HOST, TOKEN, timeout_s=5) as rx:
        send_weights([rx.address], TOKEN, 1, state)
        _, first, stats = rx.result(timeout=5)
    assert not stats["reused_buffers"]
    state2 = {k: (v + 1 if v.is_floating_point() else v - 1) for k, v in state.items()}
    with WeightReceiver(HOST, TOKEN, timeout_s=5, buffers=first) as rx:
        send_weights([rx.address], TOKEN, 2, state2)
        _check(rx, state2, 2)
        _, second, stats = rx.result()
    assert stats["reused_buffers"]
    assert all(second[k].data_ptr() == first[k].data_ptr() for k in state if state[k].numel())
    small = {"embed.weight": torch.zeros(3)}  # a shape that does not fit: fresh tensors
    with WeightReceiver(HOST, TOKEN, timeout_s=5, buffers=first) as rx:
        send_weights([rx.address], TOKEN, 3, small)
        _check(rx, small, 3)
        assert not rx.result()[2]["reused_buffers"]


def test_plan_buckets_keeps_order_and_size() -> None:
    metas = [TensorMeta(f"t{i}", torch.float32, (256,)) for i in range(10)]  # 1 KiB each
    buckets = plan_buckets(metas, 3 << 10)
    assert [len(b) for b in buckets] == [3, 3, 3, 1] and sum(buckets, []) == metas


def test_wrong_token_is_refused_and_the_right_sender_gets_through() -> None:
    state = _state()
    with WeightReceiver(HOST, TOKEN, timeout_s=5) as rx:
        with pytest.raises(WeightStreamError, match="authentication failed"):
            send_weights([rx.address], secrets.token_bytes(32), 1, state, timeout_s=5)
        # A stranger that connects and says nothing does not hold the door either.
        idle = socket.create_connection(rx.address)
        send_weights([rx.address], TOKEN, 2, state, timeout_s=5)
        _check(rx, state, 2)
        assert rx.result()[2]["refused"] == 1
        idle.close()


def _fake_hop(token: bytes, *, read_bytes: int, then: str) -> tuple[tuple[str, int], list]:
    """A hop that authenticates, takes the header and `read_bytes` of payload, then dies
    (`then="close"`) or stops reading without closing (`"stall"`, a host that vanished)."""
    srv = socket.create_server((HOST, 0))
    srv.settimeout(10)
    held: list[socket.socket] = [srv]

    def run() -> None:
        conn, _ = srv.accept()
        held.append(conn)
        proto.challenge(conn, token, "test")
        proto.read_header(conn, "test", 1 << 30)
        got = 0
        while got < read_bytes:
            got += len(conn.recv(min(65536, read_bytes - got)))
        if then == "close":
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return (HOST, srv.getsockname()[1]), held


@pytest.mark.parametrize("then", ["close", "stall"])
def test_a_hop_failing_mid_stream_fails_everyone_above_naming_it(then: str) -> None:
    # 64 MiB (one 1 MiB tensor under 64 names): far beyond the socket buffers and queues
    one = torch.randn(1 << 18)
    metas = [TensorMeta(f"w{i}", torch.float32, (1 << 18,)) for i in range(64)]
    asked: list[int] = []
    timeout = 1.0
    bad, held = _fake_hop(TOKEN, read_bytes=1 << 20, then=then)
    rxs = [WeightReceiver(HOST, TOKEN, timeout_s=timeout) for _ in range(2)]
    name = f"{bad[0]}:{bad[1]}"
    t0 = time.perf_counter()
    try:
        with pytest.raises(WeightStreamError, match=name):
            send_weights([*(r.address for r in rxs), bad], TOKEN, 5,
                         lambda b: asked.append(len(b)) or [one] * len(b), meta=metas,
                         bucket_bytes=1 << 20, chunk_bytes=1 << 20, timeout_s=timeout)
        for rx in rxs:
            with pytest.raises(WeightStreamError, match=name):
                rx.result(timeout=10)
        # a hop that dies is heard at once: the sender stops early (a stalled one fills the
        # buffers and queues first); either within the stall timeout (+ slack for this
        # loaded box): no hop waits for its own timeout in turn
        assert then == "stall" or len(asked) < 48, len(asked)
        assert time.perf_counter() - t0 < 2 * timeout + 3
    finally:
        for rx in rxs:
            rx.close()
        for s in held:
            s.close()


def test_upstream_dying_mid_stream_fails_the_receivers() -> None:
    metas = [TensorMeta("w", torch.float32, (1 << 20,))]
    with WeightReceiver(HOST, TOKEN, timeout_s=2) as last, \
            WeightReceiver(HOST, TOKEN, timeout_s=2) as first:
        sock = socket.create_connection(first.address, timeout=2)
        proto.answer(sock, TOKEN, "test")
        sock.sendall(proto.encode_header(1, metas, [last.address], CHUNK) + b"\0" * 100_000)
        sock.close()  # the trainer dies after ~100 kB of 4 MiB
        with pytest.raises(WeightStreamError, match="closed mid-stream"):
            first.result(timeout=5)
        with pytest.raises(WeightStreamError, match="mid-stream"):
            last.result(timeout=5)


def _raw_header(rx: WeightReceiver, body: bytes, length: int | None = None) -> str:
    """Authenticate, send a header (`length` may lie), return the receiver's error frame."""
    sock = socket.create_connection(rx.address, timeout=3)
    proto.answer(sock, TOKEN, "test")
    sock.sendall(struct.pack(">Q", len(body) if length is None else length) + body)
    error, _ = proto.read_status(sock, "test")
    sock.close()
    assert error
    return error


@pytest.mark.parametrize("case", ["huge_length", "huge_tensor", "bad_dtype", "not_json",
                                  "bad_shape", "bad_port"])
def test_malformed_header_is_refused_without_allocating(case: str, monkeypatch) -> None:
    allocated: list[list] = []
    real_alloc = weight_stream.alloc_tensors
    monkeypatch.setattr(weight_stream, "alloc_tensors",
                        lambda metas: allocated.append(metas) or real_alloc(metas))

    def doc(tensors: list, chain: list | None = None) -> bytes:
        return json.dumps({"version": 1, "chunk_bytes": CHUNK, "tensors": tensors,
                           "chain": chain or []}).encode()

    body, length, want = {
        "huge_length": (b"{}", 1 << 50, "exceeds"),  # never read into a 1 PiB buffer
        "huge_tensor": (doc([["w", "float32", [1 << 20, 1 << 20]]]), None, "limit"),
        "bad_dtype": (doc([["w", "object", [3]]]), None, "malformed tensor"),
        "not_json": (b"\xff{", None, "not JSON"),
        "bad_shape": (doc([["w", "float32", [-4]]]), None, "shape"),
        "bad_port": (doc([["w", "float32", [4]]], [["10.0.0.1", 70000]]), None, "port"),
    }[case]
    with WeightReceiver(HOST, TOKEN, timeout_s=3, max_bytes=1 << 30) as rx:
        assert want in _raw_header(rx, body, length)
        with pytest.raises(WeightStreamError, match=want):
            rx.result(timeout=3)
    assert allocated == []
    with WeightReceiver(HOST, TOKEN, timeout_s=3) as rx:  # the spy does see an allocation
        send_weights([rx.address], TOKEN, 1, {"w": torch.ones(4)})
        rx.result(timeout=3)
    assert len(allocated) == 1


def test_no_upstream_times_out() -> None:
    with WeightReceiver(HOST, TOKEN, timeout_s=0.3) as rx:
        with pytest.raises(WeightStreamError, match="no authenticated upstream"):
            rx.result(timeout=5)
