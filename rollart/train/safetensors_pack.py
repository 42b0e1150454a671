"""A safetensors file's bytes, written once, straight from the tensors into chunks.

`safetensors.torch.save` copies every tensor into a `bytes` object, then all of them into its
output: about 2.5x the file's size in new memory, 3.6 GB for a SmolLM2-135M checkpoint with its
AdamW moments. `pack` writes the same bytes with one copy of each tensor into `ChunkedBytes`
(rollart/storage/blob.py), which a trainer worker takes from the heap its last update freed,
and which a local store writes to the disk without a page cache copy.
"""

from __future__ import annotations

import json
import struct

import safetensors.torch
import torch
from torch import Tensor

from rollart.storage.blob import CHUNK, ChunkedBytes

HEADER_ALIGN = 8  # the JSON header is padded with spaces to a multiple of 8 bytes


def _layout(tensors: dict[str, Tensor]) -> dict[str, str]:
    """name -> safetensors dtype, in the order safetensors lays the tensors out. Taken from
    safetensors itself, on empty tensors of the same names and dtypes, so the two agree."""
    empties = {k: torch.empty(0, dtype=v.dtype) for k, v in tensors.items()}
    raw = safetensors.torch.save(empties)
    (n,) = struct.unpack("<Q", raw[:8])
    return {k: v["dtype"] for k, v in json.loads(raw[8:8 + n]).items()}


def pack(tensors: dict[str, Tensor], chunk: int = CHUNK) -> ChunkedBytes:
    """The bytes of `safetensors.torch.save(tensors)` (no metadata). Tensors that share
    storage are each written out, as `save` does after its callers untie them."""
    header: dict[str, dict[str, object]] = {}
    parts: list[tuple[Tensor, int]] = []
    offset = 0
    for name, dtype in _layout(tensors).items():
        t = tensors[name].detach()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        parts.append((t, offset))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % HEADER_ALIGN)
    prefix = struct.pack("<Q", len(head)) + head
    out = ChunkedBytes(len(prefix) + offset, chunk)
    out.write_at(0, torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    for t, at in parts:
        if t.numel():  # [numel * element_size] bytes, as laid out in memory (little-endian)
            out.write_at(len(prefix) + at, t.contiguous().reshape(-1).view(torch.uint8))
    return out
