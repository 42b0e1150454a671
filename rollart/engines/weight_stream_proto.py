"""Wire format of the weight stream (`rollart/engines/weight_stream.py`) and the pieces both
ends share: handshake, header, status frames, `Link` (one authenticated connection to the next
hop) and `Forwarder` (the hop's thread that feeds it), the staging buffers and the byte views
that let tensors be sent and received without copies.

One connection carries one stream, upstream -> downstream:

    R -> S  MAGIC (8 bytes) + nonce_r (32)              the receiver challenges
    S -> R  HMAC(token, b"up" + nonce_r) (32) + nonce_s (32)
    R -> S  HMAC(token, b"down" + nonce_s + nonce_r) (32)  mutual: S knows it reached a hop
                                                           that holds the token
    S -> R  header length (u64 big-endian) + header (UTF-8 JSON, <= MAX_HEADER_BYTES):
            {"version": int, "chunk_bytes": int,
             "tensors": [[name, dtype, shape], ...],   order of the payload
             "chain": [[host, port], ...]}            the hops after this one
    S -> R  payload: every tensor's bytes, in header order, no framing (sizes are known)
    R -> S  status frame, at the end (or as soon as a hop downstream failed):
            b"K" (ok) / b"E" (error) + u32 length + JSON {"error": str, "hops": [stats, ...]}

The token is random per sync (32 bytes) and reaches both ends through already-authenticated
calls; the two HMACs use different prefixes, so a receiver's answer can never be replayed as a
sender's proof.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import mmap
import os
import queue
import select
import socket
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MAGIC = b"RAWSTRM1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_HEADER_BYTES = 16 << 20  # 16 MiB: ~100k tensors' metadata; a longer length is malformed
MAX_STATUS_BYTES = 1 << 20
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
MAX_CHAIN = 1024
MIN_CHUNK, MAX_CHUNK = 4 << 10, 256 << 20
LAG_CHUNKS = 8  # how far a hop's forwarding may trail its receiving

# dtypes a weight may have; a name outside this table is a malformed header (never getattr on
# an arbitrary string from the wire).
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


class WeightStreamError(RuntimeError):
    """A stream failed: auth refused, a hop died or stalled, a malformed header. The message
    names the hop (host:port) where it happened."""


class HeaderError(WeightStreamError):
    """A header that breaks the format or the sanity limits (nothing was allocated)."""


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver must know before the bytes arrive: enough to preallocate."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(name: str, t: Tensor) -> TensorMeta:
        return TensorMeta(name, t.dtype, tuple(t.shape))


def addr_str(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def byte_view(t: Tensor) -> memoryview:
    """A flat uint8 memoryview of a contiguous CPU tensor's memory (writable; no copy). Works
    for any dtype (bf16 has no numpy type, its bytes do) and for 0-d and empty tensors."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.is_contiguous())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def proof(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, label + b"".join(nonces), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, what: str, peer: str) -> bytes:
    """`n` bytes (n is bounded by the caller) or WeightStreamError naming `peer`."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError as err:
            raise WeightStreamError(f"{peer}: timed out reading {what}") from err
        except OSError as err:
            raise WeightStreamError(f"{peer}: {what}: {err}") from err
        if k == 0:
            raise WeightStreamError(f"{peer}: connection closed while reading {what} "
                                    f"({got} of {n} bytes)")
        got += k
    return bytes(buf)


# ---- buffers ------------------------------------------------------------------------------
def alloc_tensors(metas: Sequence[TensorMeta]) -> dict[str, Tensor]:
    """The receiving side's one staging copy: views into one private anonymous mapping (each
    tensor 64-byte aligned) advised for transparent huge pages: first-touch page faults on a
    fresh 538 MB buffer cost ~0.2-0.3 CPU s per sync with 4 kB pages, ~0.06-0.2 with 2 MB
    ones (measured here), and every receiver pays them on every sync."""
    offsets, size = [], 0
    for m in metas:
        offsets.append(size)
        size += -(-m.nbytes // 64) * 64
    if size == 0:
        return {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive while any view is
    return {m.name: flat[o:o + m.nbytes].view(m.dtype).view(m.shape)
            for m, o in zip(metas, offsets, strict=True)}


def fits_buffers(buffers: Mapping[str, Tensor] | None, metas: Sequence[TensorMeta]) -> bool:
    return buffers is not None and all(
        (b := buffers.get(m.name)) is not None and b.dtype == m.dtype
        and tuple(b.shape) == m.shape and b.device.type == "cpu" and b.is_contiguous()
        for m in metas)


def pieces(view: memoryview, chunk: int) -> Iterator[memoryview]:
    for off in range(0, len(view), chunk):
        yield view[off:off + chunk]


# ---- handshake ---------------------------------------------------------------------------
def challenge(sock: socket.socket, token: bytes, peer: str) -> None:
    """Receiver side; raises WeightStreamError if the peer does not hold `token`."""
    nonce_r = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_r)
    reply = recv_exact(sock, MAC_BYTES + NONCE_BYTES, "auth reply", peer)
    if not hmac.compare_digest(reply[:MAC_BYTES], proof(token, b"up", nonce_r)):
        raise WeightStreamError(f"{peer}: authentication failed (wrong token)")
    sock.sendall(proof(token, b"down", reply[MAC_BYTES:], nonce_r))


def answer(sock: socket.socket, token: bytes, peer: str) -> None:
    """Sender side (the trainer, or a hop forwarding downstream)."""
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, "greeting", peer)
    if hello[:len(MAGIC)] != MAGIC:
        raise WeightStreamError(f"{peer}: not a weight-stream receiver (bad magic)")
    nonce_r, nonce_s = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    sock.sendall(proof(token, b"up", nonce_r) + nonce_s)
    try:
        back = recv_exact(sock, MAC_BYTES, "auth answer", peer)
    except WeightStreamError as err:
        raise WeightStreamError(f"{peer}: refused the token (authentication failed): "
                                f"{err}") from err
    if not hmac.compare_digest(back, proof(token, b"down", nonce_s, nonce_r)):
        raise WeightStreamError(f"{peer}: receiver does not hold the token")


# ---- header ------------------------------------------------------------------------------
def encode_header(version: int, metas: list[TensorMeta], chain: list[tuple[str, int]],
                  chunk_bytes: int) -> bytes:
    body = json.dumps({
        "version": int(version), "chunk_bytes": int(chunk_bytes),
        "tensors": [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)] for m in metas],
        "chain": [[h, int(p)] for h, p in chain]}, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise WeightStreamError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return struct.pack(">Q", len(body)) + body


def _int(x: Any, lo: int, hi: int, what: str) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise HeaderError(f"{what}: {x!r:.80} is not an integer in [{lo}, {hi}]")
    return x


def read_header(sock: socket.socket, peer: str, max_bytes: int
                ) -> tuple[int, list[TensorMeta], list[tuple[str, int]], int]:
    """-> (version, metas, rest of the chain, chunk_bytes). Every limit is checked before the
    caller allocates anything: at most MAX_HEADER_BYTES are read, tensor count, name length,
    rank and the payload's total size (<= max_bytes) are bounded."""
    (n,) = struct.unpack(">Q", recv_exact(sock, 8, "header length", peer))
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{peer}: header length {n} exceeds {MAX_HEADER_BYTES}")
    try:
        doc = json.loads(recv_exact(sock, n, "header", peer))
    except (UnicodeDecodeError, ValueError) as err:
        raise HeaderError(f"{peer}: header is not JSON: {err}") from err
    if not isinstance(doc, dict) or not {"version", "chunk_bytes", "tensors", "chain"} <= set(doc):
        raise HeaderError(f"{peer}: header lacks version/chunk_bytes/tensors/chain")
    version = _int(doc["version"], -(1 << 62), 1 << 62, "version")
    chunk = _int(doc["chunk_bytes"], MIN_CHUNK, MAX_CHUNK, "chunk_bytes")
    items, chain_in = doc["tensors"], doc["chain"]
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise HeaderError(f"{peer}: tensors must be a list of at most {MAX_TENSORS}")
    if not isinstance(chain_in, list) or len(chain_in) > MAX_CHAIN:
        raise HeaderError(f"{peer}: chain must be a list of at most {MAX_CHAIN} hops")
    metas, names, total = [], set(), 0
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and 0 < len(item[0]) <= MAX_NAME_CHARS and item[1] in DTYPES
                and isinstance(item[2], list) and len(item[2]) <= MAX_NDIM):
            raise HeaderError(f"{peer}: malformed tensor entry {str(item)[:120]}")
        if item[0] in names:
            raise HeaderError(f"{peer}: tensor {item[0]!r} listed twice")
        names.add(item[0])
        shape = tuple(_int(d, 0, max_bytes, f"shape of {item[0]!r}") for d in item[2])
        meta = TensorMeta(item[0], DTYPES[item[1]], shape)
        total += meta.nbytes
        if total > max_bytes:  # checked as we go: the product of huge dims never piles up
            raise HeaderError(f"{peer}: payload exceeds the limit of {max_bytes} bytes")
        metas.append(meta)
    chain = []
    for hop in chain_in:
        if not (isinstance(hop, list) and len(hop) == 2 and isinstance(hop[0], str)
                and 0 < len(hop[0]) <= 255):
            raise HeaderError(f"{peer}: malformed chain entry {str(hop)[:120]}")
        chain.append((hop[0], _int(hop[1], 1, 65535, "port")))
    return version, metas, chain, chunk


# ---- status frames (downstream -> upstream) ----------------------------------------------
def send_status(sock: socket.socket, error: str | None, hops: list[dict[str, Any]]) -> None:
    body = json.dumps({"error": error and error[:4000], "hops": hops[:MAX_CHAIN]}).encode()
    sock.sendall((b"E" if error else b"K") + struct.pack(">I", len(body)) + body)


def read_status(sock: socket.socket, peer: str) -> tuple[str | None, list[dict[str, Any]]]:
    """-> (error or None, per-hop stats from `peer` on down)."""
    head = recv_exact(sock, 5, "status", peer)
    (n,) = struct.unpack(">I", head[1:])
    if head[:1] not in (b"K", b"E") or n > MAX_STATUS_BYTES:
        raise WeightStreamError(f"{peer}: malformed status frame")
    try:
        doc = json.loads(recv_exact(sock, n, "status", peer))
        error, hops = doc["error"], list(doc["hops"])
    except (ValueError, KeyError, TypeError) as err:
        raise WeightStreamError(f"{peer}: malformed status frame: {err}") from err
    if head[:1] == b"E":
        return str(error or f"{peer}: failed"), hops
    return None, hops


def tune(sock: socket.socket, timeout_s: float, sock_buf: int | None) -> None:
    """Every op on `sock` times out; Nagle off (the status frames are small and must not wait
    for a delayed ACK); optional fixed buffers (None: the kernel's autotuning)."""
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sock_buf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)


# ---- one link of the chain, upstream side -----------------------------------------------
class Link:
    """An authenticated connection to the next hop with the header sent. `send` streams a
    piece and then looks (without blocking) for an error frame the hop sent back early.

    When a hop stalls, every hop above it stalls too, at about the same moment; with equal
    timeouts the one above could give up first and blame its (healthy, blocked) neighbour.
    So a link is patient in proportion to the hops below its peer, `(1 + below) * timeout_s`:
    the hop right above the culprit times out first and reports, and the report reaches each
    hop above before its own, longer, timeout. A failure surfaces within that bound."""

    def __init__(self, addr: tuple[str, int], token: bytes, header: bytes, timeout_s: float,
                 sock_buf: int | None, below: int) -> None:
        self.peer = f"hop {addr_str(addr)}"
        self.sent, self.timeout_s, self.below = 0, timeout_s, below
        try:
            self.sock = socket.create_connection(addr, timeout=timeout_s)
        except OSError as err:
            raise WeightStreamError(f"{self.peer}: cannot connect: {err}") from err
        try:
            tune(self.sock, timeout_s, sock_buf)
            answer(self.sock, token, self.peer)
            self.sock.settimeout(timeout_s * (1 + below))
            self._sendall(header)
        except BaseException:
            self.sock.close()
            raise

    def _sendall(self, data: memoryview | bytes) -> None:
        try:
            self.sock.sendall(data)
        except TimeoutError as err:  # stuck because a hop below failed? it says so
            self._early_status(0.5, quiet=True)
            raise WeightStreamError(f"{self.peer}: no progress for {self.sock.gettimeout()} s "
                                    f"(stalled or gone) after {self.sent} bytes") from err
        except OSError as err:  # it may have said why before it went: prefer its own word
            self._early_status(0.5, quiet=True)
            raise WeightStreamError(f"{self.peer} failed mid-stream after {self.sent} bytes: "
                                    f"{err}") from err

    def _early_status(self, wait_s: float, quiet: bool = False) -> None:
        """Raise the hop's error frame if one is waiting (the hop failed or its downstream did:
        it reports at once, while we are still sending). `quiet`: no frame, no error."""
        try:
            ready = select.select([self.sock], [], [], wait_s)[0]
        except (OSError, ValueError):
            return
        if ready:
            try:
                if self.sock.recv(1, socket.MSG_PEEK) == b"K":
                    return  # done below already (the last piece): finish() reads it
                error, _ = read_status(self.sock, self.peer)
            except (WeightStreamError, OSError) as err:  # it hung up (died) without a word
                if quiet:
                    return
                raise WeightStreamError(f"{self.peer} failed mid-stream after {self.sent} "
                                        f"bytes: {err}") from err
            raise WeightStreamError(f"{self.peer} reported: {error}" if error else
                                    f"{self.peer}: acknowledged before the payload ended")

    def send(self, piece: memoryview) -> None:
        self._sendall(piece)
        self.sent += len(piece)
        self._early_status(0.0)

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the hop's status: it comes once the hop and all below it have everything
        (each hop trails its upstream by a few chunks) or as soon as one of them failed."""
        error, hops = read_status(self.sock, self.peer)
        if error:
            raise WeightStreamError(f"{self.peer} reported: {error}")
        return hops

    def close(self) -> None:
        self.sock.close()


class Forwarder(threading.Thread):
    """Sends queued pieces (views of tensors already received) down the chain while the
    receiving thread goes on: the two syscalls release the GIL, so they overlap. The queue is
    short (LAG_CHUNKS): a slow link below slows the links above (backpressure), so no hop
    finishes far ahead of the next and a status wait stays within the timeouts."""

    def __init__(self, link: Link) -> None:
        super().__init__(daemon=True, name=f"weight-forward-{link.peer}")
        self.link = link
        self.q: queue.Queue[memoryview | None] = queue.Queue(maxsize=LAG_CHUNKS)
        self.error: BaseException | None = None
        self.stopped = False
        self.hops: list[dict[str, Any]] = []

    def run(self) -> None:
        ended = False
        try:
            while (piece := self.q.get()) is not None:
                self.link.send(piece)
            ended = True
            self.hops = self.link.finish()
        except BaseException as err:  # noqa: BLE001 - reported through .error
            self.error = err
            while not (ended or self.stopped):  # unblock the receiving thread until it stops
                try:
                    if self.q.get(timeout=0.5) is None:
                        break
                except queue.Empty:
                    pass

    def stop(self) -> None:
        """The receiving side failed: wake the sender thread, hang up on the hop below (it
        sees its upstream close mid-stream and fails in turn)."""
        self.stopped = True
        try:
            self.link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.q.put_nowait(None)
        except queue.Full:
            pass

    def put(self, piece: memoryview | None) -> None:
        try:
            self.q.put(piece, timeout=(2 + self.link.below) * self.link.timeout_s)
        except queue.Full as err:
            raise WeightStreamError(f"{self.link.peer}: forwarding stalled") from err
