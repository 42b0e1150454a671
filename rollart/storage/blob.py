"""A large file's bytes held as page-aligned chunks, and how they reach a local disk.

Why: a checkpoint snapshot is the biggest allocation a trainer makes after its first updates
(SmolLM2-135M's weights and AdamW moments are 1.6 GB). On the VMs here memory the process has
not touched before costs ~7-20 us per 4 KiB page to fault in (the host backs it lazily), so a
snapshot into fresh buffers, and the page cache a buffered write fills, cost seconds each.
Chunks of `CHUNK` bytes come out of the trainer worker's retained heap (the freed activations
of its last update: infra/dask_cluster.py keeps them), and a local write goes from those
chunks straight to the disk (`O_DIRECT`), filling no page cache; the fsync that follows makes
it durable as before.

`ChunkedBytes` is the one other type a store accepts where it accepts `bytes` (`Blob`): it has a
length, compares equal to `bytes` of the same content, slices to `bytes`, and converts with
`bytes(...)`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

ALIGN = 4096  # O_DIRECT: buffer address, length and file offset in multiples of this
CHUNK = 32 << 20  # a multiple of ALIGN


def _aligned(nbytes: int) -> np.ndarray:
    """A uint8 buffer of `nbytes` (rounded up to ALIGN) whose first byte is ALIGN-aligned."""
    cap = -(-nbytes // ALIGN) * ALIGN
    raw = np.empty(cap + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + cap]


class ChunkedBytes:
    """`size` bytes in chunks of CHUNK bytes (the last one shorter), each ALIGN-aligned and with
    room to pad the last one to a multiple of ALIGN. Filled by `write_at`, then read-only."""

    def __init__(self, size: int, chunk: int = CHUNK) -> None:
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}, got {chunk}")
        self.size, self.chunk = size, chunk
        self.chunks = [_aligned(min(chunk, size - at)) for at in range(0, size, chunk)]

    def __len__(self) -> int:
        return self.size

    def _lengths(self) -> Iterator[tuple[np.ndarray, int]]:
        for i, c in enumerate(self.chunks):
            yield c, min(self.chunk, self.size - i * self.chunk)

    def write_at(self, at: int, data: torch.Tensor) -> None:
        """Copy `data` (a uint8 tensor, 1-D, any device) into bytes [at, at + len(data))."""
        import torch

        done = 0
        while done < data.numel():
            i, off = divmod(at + done, self.chunk)
            n = min(self.chunk - off, data.numel() - done)
            # torch's copy: several threads, and straight from a GPU where the tensor lives
            torch.from_numpy(self.chunks[i][off:off + n]).copy_(data[done:done + n])
            done += n

    def views(self) -> Iterator[memoryview]:
        """The content, chunk by chunk (no copies)."""
        for c, n in self._lengths():
            yield c[:n].data

    def padded_views(self) -> Iterator[memoryview]:
        """Chunk by chunk, the last one zero-padded to a multiple of ALIGN (for O_DIRECT)."""
        for c, n in self._lengths():
            pad = -n % ALIGN
            if pad:
                c[n:n + pad] = 0
            yield c[:n + pad].data

    def __bytes__(self) -> bytes:
        return b"".join(self.views())

    def __getitem__(self, key: slice) -> bytes:
        """A slice as bytes (an S3 multipart upload cuts its parts this way)."""
        if not isinstance(key, slice):
            raise TypeError("ChunkedBytes supports slices only")
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("ChunkedBytes slices take no step")
        out, at = [], start
        while at < stop:
            i, off = divmod(at, self.chunk)
            n = min(self.chunk - off, stop - at)
            out.append(self.chunks[i][off:off + n].tobytes())
            at += n
        return b"".join(out)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkedBytes):
            other = bytes(other)
        if not isinstance(other, bytes | bytearray | memoryview):
            return NotImplemented
        if len(other) != self.size:
            return False
        want = np.frombuffer(other, dtype=np.uint8)
        at = 0
        for view in self.views():
            if not np.array_equal(np.frombuffer(view, dtype=np.uint8), want[at:at + len(view)]):
                return False
            at += len(view)
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable until filled, like bytearray

    def __repr__(self) -> str:
        return f"ChunkedBytes({self.size} bytes in {len(self.chunks)} chunks)"


Blob: TypeAlias = "bytes | ChunkedBytes"


def as_bytes(data: Blob) -> bytes:
    """`data` as one `bytes` object (a copy for ChunkedBytes)."""
    return data if isinstance(data, bytes) else bytes(data)


def blob_views(data: Blob) -> Iterator[memoryview]:
    if isinstance(data, ChunkedBytes):
        yield from data.views()
    else:
        yield memoryview(data)


def crc32(data: Blob) -> int:
    value = 0
    for view in blob_views(data):
        value = zlib.crc32(view, value)
    return value & 0xFFFFFFFF


def sha256(data: Blob) -> Any:
    h = hashlib.sha256()
    for view in blob_views(data):
        h.update(view)
    return h


def write_direct(fd: int, data: ChunkedBytes) -> bool:
    """Write `data` from the start of the empty file `fd` (opened with O_DIRECT) and cut the
    padding off. False, having written nothing, where the filesystem refuses O_DIRECT writes
    (EINVAL: tmpfs, some FUSE and network filesystems); the caller then writes through the page
    cache."""
    first = True
    for view in data.padded_views():
        done = 0
        while done < len(view):
            try:
                done += os.write(fd, view[done:])
            except OSError as err:
                if first and err.errno == errno.EINVAL:  # no direct I/O here
                    return False
                raise
            first = False
    os.ftruncate(fd, data.size)
    return True
