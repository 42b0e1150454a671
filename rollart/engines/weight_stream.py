"""Trainer -> engines weight sync across hosts: one bucketed TCP stream, pipelined along a chain.

The trainer's rank 0 connects to the first engine only; each engine writes what it receives
straight into its preallocated tensors and forwards the same bytes to the next engine while
more arrive (a forwarder thread sends from the tensors' memory, so receiving and forwarding
overlap). Every link carries the payload once, so the sync takes about one payload time plus a
chunk per hop, not M payload times through the sender's link, and the flow process never holds
the weights. Engines on the trainer's own host use `shared_weights.py` instead.

    rx = WeightReceiver(host, token, timeout_s=60)      # in each engine, one per sync
    ... rx.address goes to the trainer (through the authenticated Dask actor call)
    send_weights([rx0.address, rx1.address], token, version, state_dict)   # trainer rank 0
    version, tensors, stats = rx.result(timeout=60)     # in each engine

A sharded trainer never holds a full extra copy: it passes `meta` (names, dtypes, shapes are
known without gathering) and a callable that gathers one bucket (~bucket_bytes) of full
parameters at a time; the sender calls it bucket by bucket and streams each tensor as it comes.

Security: every connection is authenticated when it opens (a per-sync random token, HMAC
challenge-response both ways: the upstream proves it holds the token, and so does the hop), so
no one without the token can feed an engine weights or receive them by posing as a hop. The
payload itself is neither encrypted nor MAC'd (the same as NCCL/Gloo, which do not even
authenticate): an attacker who can read or inject packets on the cluster network can read the
weights or hijack an established connection. That is acceptable inside a private cluster
network (a VPC/fabric reachable only by the cluster's own machines, where the weights already
travel in clear through NCCL); it is not across a shared or untrusted network, where the links
belong in an encrypted overlay (WireGuard/IPsec) or a TLS variant (at the CPU cost of the
cipher on every hop).

Failures: every socket op has a timeout; a hop that fails (dies, stalls, or its downstream
failed) is reported upstream with its address as soon as it is seen (an error frame the
upstream notices between chunks), so the sender and every hop above it fail with an error
naming it. Nothing waits forever: a link waits `(1 + hops below it) * timeout_s` for progress
(`weight_stream_proto.Link` says why), so the sender hears within `M * timeout_s` at worst.
Wire format and the shared pieces: `weight_stream_proto.py`.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from rollart.engines.weight_stream_proto import (
    Forwarder,
    HeaderError,
    Link,
    TensorMeta,
    WeightStreamError,
    addr_str,
    alloc_tensors,
    byte_view,
    challenge,
    encode_header,
    fits_buffers,
    pieces,
    read_header,
    send_status,
    tune,
)

__all__ = ["HeaderError", "TensorMeta", "WeightReceiver", "WeightStreamError", "plan_buckets",
           "send_weights"]

# Unit of send/recv/forward. benchmarks/weight_sync.py swept 1, 4, 8 MiB: all within noise; a
# hop forwards a chunk once it holds all of it, so a chunk is also the per-hop pipeline delay.
CHUNK_BYTES = 4 << 20
BUCKET_BYTES = 64 << 20  # what one gather of a sharded trainer produces (and holds) at a time
MAX_PENDING = 16  # handshakes in progress at once on one receiver
Producer = Callable[[list[TensorMeta]], Sequence[Tensor]]


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive groups of about `bucket_bytes` (a tensor larger than that is a bucket)."""
    out: list[list[TensorMeta]] = [[]]
    size = 0
    for m in metas:
        if out[-1] and size + m.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.nbytes
    return [b for b in out if b]


# ---- sender (trainer rank 0) -------------------------------------------------------------
def _producer(tensors: Any, meta: Sequence[TensorMeta] | None, bucket_bytes: int
              ) -> tuple[list[TensorMeta], Callable[[], Iterator[Tensor]], bool]:
    """-> (metadata, a function that yields the values in order, whether it can run again)."""
    if callable(tensors):
        if meta is None:
            raise ValueError("a bucket producer needs `meta`")
        metas, fn = list(meta), tensors

        def gathered() -> Iterator[Tensor]:
            for bucket in plan_buckets(metas, bucket_bytes):
                values = fn(bucket)
                if len(values) != len(bucket):
                    raise WeightStreamError(f"producer gave {len(values)} tensors for a bucket "
                                            f"of {len(bucket)}")
                yield from values
                del values  # the bucket's memory goes before the next gather
        return metas, gathered, True
    if meta is None:
        pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        return [TensorMeta.of(n, t) for n, t in pairs], lambda: (t for _, t in pairs), True
    it = iter(tensors)
    return list(meta), lambda: (x[1] if isinstance(x, tuple) else x for x in it), False


def _stream(link: Link, metas: list[TensorMeta], values: Iterator[Tensor], chunk: int
            ) -> float:
    """Every tensor's bytes into `link`; -> seconds spent producing values."""
    produce_s = 0.0
    for m in metas:
        t0 = time.perf_counter()
        t = next(values, None)
        if t is None:
            raise WeightStreamError(f"values ended before tensor {m.name!r}")
        t = t.detach()
        if t.dtype != m.dtype or tuple(t.shape) != m.shape:
            raise WeightStreamError(f"tensor {m.name!r} is {t.dtype} {tuple(t.shape)}, "
                                    f"the header said {m.dtype} {m.shape}")
        t = t.to("cpu").contiguous()  # no-op for contiguous CPU tensors
        produce_s += time.perf_counter() - t0
        for piece in pieces(byte_view(t), chunk):
            link.send(piece)
    return produce_s


def send_weights(chain: Sequence[tuple[str, int]], token: bytes, version: int,
                 tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
                 | Iterable[Tensor] | Producer, *, meta: Sequence[TensorMeta] | None = None,
                 bucket_bytes: int = BUCKET_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 timeout_s: float = 60.0, mode: str = "chain", sock_buf: int | None = None
                 ) -> dict[str, Any]:
    """Stream weights `version` to every receiver in `chain`; returns once all have them.

    `tensors`: a state dict or (name, tensor) pairs (metadata read from them), or with `meta`
    (names/dtypes/shapes, in payload order) either an iterator of the values in that order or a
    producer `f(bucket: list[TensorMeta]) -> list[Tensor]` called once per ~`bucket_bytes`
    bucket (a sharded trainer's gather). Values may be any device/layout; each is sent from a
    contiguous CPU copy (none for contiguous CPU tensors); tied tensors go under each name.
    `mode`: "chain" (pipelined: the sender feeds chain[0], which forwards) or "star" (the
    whole payload to each receiver in turn: the M-copies baseline; needs re-runnable values).
    Returns {"bytes", "seconds", "mb_per_s", "produce_s", "hops": [per-receiver stats]}.
    Raises WeightStreamError naming the hop that failed."""
    if mode not in ("chain", "star"):
        raise ValueError(f"mode {mode!r}: chain or star")
    if not chain:
        raise ValueError("no receivers")
    metas, values, rerun = _producer(tensors, meta, bucket_bytes)
    routes = [list(chain)] if mode == "chain" else [[a] for a in chain]
    if len(routes) > 1 and not rerun:
        raise ValueError("star mode sends the values once per receiver: pass a state dict, "
                         "pairs or a bucket producer, not a one-shot iterator")
    t0 = time.perf_counter()
    hops: list[dict[str, Any]] = []
    produce_s = 0.0
    for route in routes:
        header = encode_header(version, metas, [tuple(a) for a in route[1:]], chunk_bytes)
        link = Link(tuple(route[0]), token, header, timeout_s, sock_buf, len(route) - 1)
        try:
            produce_s += _stream(link, metas, values(), chunk_bytes)
            hops += link.finish()
        finally:
            link.close()
    seconds = time.perf_counter() - t0
    nbytes = sum(m.nbytes for m in metas)
    return {"mode": mode, "engines": len(chain), "bytes": nbytes, "seconds": seconds,
            "mb_per_s": nbytes / 1e6 / max(seconds, 1e-9), "produce_s": produce_s,
            "chunk_bytes": chunk_bytes, "hops": hops}


# ---- receiver (engine) -------------------------------------------------------------------
class WeightReceiver:
    """One incoming stream (one weight version) for an engine process; see the module doc.

    Listens on `host` (port 0: `.address`); the upstream must authenticate with `token` within
    `timeout_s` (a connection that fails is dropped and the receiver keeps waiting). Tensors
    are preallocated from the header (the one staging copy; the engine loads from them) and
    filled with recv_into; chunks are forwarded to the rest of the chain as they arrive.
    `max_bytes` bounds what a header may make it allocate (default: the machine's memory).
    `buffers`: the previous sync's tensors (from `.result()`), received into again when every
    name, dtype and shape matches: the staging copy stays mapped between syncs instead of
    being faulted in afresh each time (~1.2 CPU s per 538 MB on a VM that hands freed memory
    back to its host). They are overwritten as bytes arrive: never pass live weights."""

    def __init__(self, host: str, token: bytes, timeout_s: float = 60.0, *,
                 max_bytes: int | None = None, sock_buf: int | None = None,
                 buffers: Mapping[str, Tensor] | None = None) -> None:
        self.token, self.timeout_s, self.sock_buf = token, timeout_s, sock_buf
        self.buffers = buffers
        self.max_bytes = max_bytes or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self._lsock = socket.create_server((host, 0), backlog=16)
        self.address: tuple[str, int] = (host, self._lsock.getsockname()[1])
        self.name = f"receiver {addr_str(self.address)}"
        self.refused = 0
        self._socks: list[socket.socket] = [self._lsock]
        self._done = threading.Event()
        self._closed = False
        self._out: tuple[int, dict[str, Tensor], dict[str, Any]] | None = None
        self._error: BaseException | None = None
        self._t_open = time.perf_counter()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"weight-{self.name}")
        self._thread.start()

    def result(self, timeout: float | None = None
               ) -> tuple[int, dict[str, Tensor], dict[str, Any]]:
        """-> (version, {name: tensor}, stats). Raises WeightStreamError if the upstream or a
        hop downstream failed, or TimeoutError if nothing finished within `timeout`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name}: no complete stream within {timeout} s")
        if self._error is not None:
            raise WeightStreamError(f"{self.name}: {self._error}") from self._error
        assert self._out is not None
        return self._out

    def close(self) -> None:
        """Stop (a blocked accept/recv wakes up) and drop the tensors' references."""
        self._closed = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._thread.join(timeout=5.0)
        self._out = None

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            self._out = self._run()
        except BaseException as err:  # noqa: BLE001 - handed to result()
            self._error = err
        finally:
            for s in self._socks:
                s.close()
            self._done.set()

    def _accept(self) -> socket.socket:
        """The first connection that proves the token. Handshakes run in their own threads
        (at most MAX_PENDING at once), so a silent or slow stranger cannot hold the door."""
        deadline = self._t_open + self.timeout_s
        won: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        wake_r, wake_w = socket.socketpair()
        self._socks += [wake_r, wake_w]
        pending = [0]
        lock = threading.Lock()

        def handshake(conn: socket.socket, peer: str, budget: float) -> None:
            try:
                tune(conn, budget, self.sock_buf)
                challenge(conn, self.token, f"upstream {peer}")
                conn.settimeout(self.timeout_s)
                won.put(conn)
                wake_w.send(b"!")
            except (WeightStreamError, OSError):
                with lock:
                    self.refused += 1
                conn.close()
            finally:
                with lock:
                    pending[0] -= 1

        while (left := deadline - time.perf_counter()) > 0:
            try:
                ready = select.select([self._lsock, wake_r], [], [], left)[0]
            except (OSError, ValueError) as err:
                raise WeightStreamError(f"closed while waiting ({err})") from err
            if wake_r in ready:
                conn = won.get()
                self._socks.append(conn)
                self._lsock.close()  # one stream per receiver
                return conn
            if self._lsock in ready:
                try:
                    conn, peer = self._lsock.accept()
                except OSError as err:
                    raise WeightStreamError(f"closed while waiting ({err})") from err
                with lock:
                    if pending[0] >= MAX_PENDING:
                        self.refused += 1
                        conn.close()
                        continue
                    pending[0] += 1
                threading.Thread(target=handshake, daemon=True, args=(
                    conn, addr_str(peer), max(min(left, self.timeout_s, 10.0), 0.1))).start()
        raise WeightStreamError(f"no authenticated upstream within {self.timeout_s} s "
                                f"({self.refused} connection(s) refused)")

    def _run(self) -> tuple[int, dict[str, Tensor], dict[str, Any]]:
        up = self._accept()
        peer, fwd, got, t_first = "upstream", None, 0, None
        try:
            version, metas, chain, chunk = read_header(up, peer, self.max_bytes)
            reused = fits_buffers(self.buffers, metas)
            tensors = ({m.name: self.buffers[m.name] for m in metas} if reused  # type: ignore
                       else alloc_tensors(metas))
            self.buffers = None
            if chain:
                link = Link(chain[0], self.token, encode_header(version, metas, chain[1:],
                                                                 chunk),
                             self.timeout_s, self.sock_buf, len(chain) - 1)
                self._socks.append(link.sock)
                fwd = Forwarder(link)
                fwd.start()
            total = sum(m.nbytes for m in metas)
            for m in metas:
                for piece in pieces(byte_view(tensors[m.name]), chunk):
                    n = 0
                    while n < len(piece):
                        try:
                            k = up.recv_into(piece[n:])
                        except TimeoutError as err:
                            raise WeightStreamError(f"{peer}: no data for {self.timeout_s} s "
                                                    f"({got} of {total} bytes)") from err
                        except OSError as err:
                            raise WeightStreamError(f"{peer}: {err} ({got} of {total} bytes)"
                                                    ) from err
                        if k == 0:
                            raise WeightStreamError(f"{peer} closed mid-stream ({got} of "
                                                    f"{total} bytes)")
                        t_first = t_first or time.perf_counter()
                        n += k
                        got += k
                    if fwd is not None:
                        if fwd.error is not None:
                            raise fwd.error
                        fwd.put(piece)
            t_last = time.perf_counter()
            hops: list[dict[str, Any]] = []
            if fwd is not None:
                fwd.put(None)
                fwd.join(timeout=(3 + len(chain)) * self.timeout_s)  # its ops time out
                if fwd.error is not None or fwd.is_alive():
                    raise fwd.error or WeightStreamError("forwarder did not finish")
                hops = fwd.hops
        except BaseException as err:
            if fwd is not None:
                fwd.stop()
            self._report(up, f"{self.name}: {err}")
            raise
        t_first = t_first or t_last
        stats = {"addr": addr_str(self.address), "bytes": total, "tensors": len(metas),
                 "seconds": t_last - t_first, "mb_per_s": total / 1e6 / max(t_last - t_first,
                                                                             1e-9),
                 "first_byte_wait_s": t_first - self._t_open,
                 "done_s": time.perf_counter() - self._t_open,
                 "done_monotonic": time.monotonic(), "refused": self.refused,
                 "reused_buffers": reused}
        send_status(up, None, [stats, *hops])
        return version, tensors, {**stats, "downstream": hops}

    def _report(self, up: socket.socket, error: str) -> None:
        """Tell the upstream at once, then read (and drop) what it still sends until it hangs
        up, at most a few seconds: closing with unread data would reset the connection and
        could lose the error frame before the upstream read it."""
        if self._closed:
            return
        try:
            send_status(up, error, [])
            up.shutdown(socket.SHUT_WR)
            up.settimeout(min(self.timeout_s, 2.0))
            deadline = time.perf_counter() + min(self.timeout_s, 5.0)
            while time.perf_counter() < deadline and up.recv(1 << 20):
                pass
        except OSError:
            pass

