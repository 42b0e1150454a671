"""Is a checkpoint file well-formed, judged from its header, before anything loads it?

A file can match its manifest (size, digest) and still not load: written broken, or by a
version whose format this one refuses. Found only when the trainer loads it, that ends the
resume with a traceback on a worker; found here, when the resume picks its checkpoint, the
checkpoint is skipped with one line and the previous one is used, as for a CRC mismatch.

The checks read headers only (safetensors' JSON header and its offsets, Parquet's footer), or
parse small text formats (JSON, YAML) whole; they never build tensors and never unpickle. Names
of other kinds are not judged, except the pickles of older versions (`rng.pt`,
`optimizer.pt`), which this version never loads (rollart/train/state_io.py).
"""

from __future__ import annotations

import json
import math
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

# Pickles of older rollart versions: refused by the loader, so refused when picking a checkpoint.
LEGACY_PICKLES = ("rng.pt", "optimizer.pt")
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER = 100 * 2**20  # safetensors' own limit


def safetensors_problem(data: bytes) -> str | None:
    """Why `data` is not a safetensors file (None when its header is sound): the header's
    length, its JSON, and every tensor's dtype, shape and byte range inside the file."""
    if len(data) < 8:
        return "is not a safetensors file (shorter than its header length)"
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER, len(data) - 8):
        return "has a corrupt safetensors header (its length runs past the file)"
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        return "has a corrupt safetensors header (not JSON)"
    if not isinstance(header, dict):
        return "has a corrupt safetensors header (not a JSON object)"
    body = len(data) - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            return f"has a corrupt safetensors header (tensor {name[:60]!r})"
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if (not isinstance(dtype, str) or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= body):
            return f"has a corrupt safetensors header (tensor {name[:60]!r})"
        size = _ITEMSIZE.get(dtype)
        if size is not None and offsets[1] - offsets[0] != math.prod(shape) * size:
            return f"has a corrupt safetensors header (tensor {name[:60]!r} size)"
    return None


def format_problem(name: str, data: bytes) -> str | None:
    """Why checkpoint file `name` cannot be loaded, judged by its kind; None when it can (or
    when its kind is not judged)."""
    base = name.rsplit("/", 1)[-1]
    if base in LEGACY_PICKLES:
        return "is a pickle (a checkpoint of an older rollart), which is never loaded"
    if base.endswith(".safetensors"):
        return safetensors_problem(data)
    if base.endswith(".json"):
        try:
            json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return "is not valid JSON"
    elif base.endswith((".yaml", ".yml")):
        try:
            yaml.safe_load(data)
        except (yaml.YAMLError, UnicodeDecodeError):
            return "is not valid YAML"
    elif base.endswith(".parquet"):
        if data[:4] != b"PAR1" or data[-4:] != b"PAR1":
            return "is not a Parquet file (no PAR1 magic)"
        try:
            pq.read_metadata(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError):
            return "has a corrupt Parquet footer"
    return None
