"""Optimizer and RNG state in formats that cannot run code when loaded.

A checkpoint comes back from the store, which other people (or a compromised job) can write:
a pickle there runs arbitrary code on `--resume`. So nothing here unpickles:

- optimizer: every tensor of `optimizer.state_dict()["state"]` in `optimizer.safetensors`
  (`state.{param index}.{name}`), the rest (param groups, non-tensor per-parameter values) in
  `optimizer.json`;
- RNG: torch's generator state (a uint8 tensor) in `rng.safetensors`; numpy's MT19937 state and
  Python's `random` state in `rng.json`.

JSON is written with sorted keys and floats in repr form, so an exact resume writes the same
bytes as an uninterrupted run. Checkpoints of older versions (`optimizer.pt`, `rng.pt`) are read
with `torch.load(weights_only=True)`, which refuses anything but tensors and plain containers;
an older `rng.pt` holds numpy objects that it refuses, so such a checkpoint is refused with a
message that says why, never loaded by a full unpickler.
"""

from __future__ import annotations

import io
import json
import math
import random
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import Tensor

SAFE_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json")
LEGACY_FILES = ("optimizer.pt", "rng.pt")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file cannot be loaded without executing code from it, or is malformed."""


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _number(v: Any) -> Any:
    """JSON has no inf/nan: keep them as strings, restored exactly by _unnumber."""
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if isinstance(v, tuple | list):
        return [_number(x) for x in v]
    return v


def _unnumber(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"float"}:
        return float(v["float"])
    if isinstance(v, list):
        return [_unnumber(x) for x in v]
    return v


def optimizer_files(optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = _number(value)
    groups = [{k: _number(v) for k, v in g.items()} for g in sd["param_groups"]]
    return {"optimizer.safetensors": safetensors.torch.save(tensors),
            "optimizer.json": _json({"param_groups": groups, "scalars": scalars})}


def load_optimizer(optimizer: torch.optim.Optimizer, files: dict[str, bytes]) -> None:
    if "optimizer.json" not in files:
        if "optimizer.pt" not in files:
            raise UnsafeCheckpointError("checkpoint has no optimizer state")
        try:  # older checkpoints: tensors and plain containers only, no code
            sd = torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True)
        except Exception as err:  # noqa: BLE001 - the unpickler's refusal, whatever its type
            raise UnsafeCheckpointError(
                f"optimizer.pt is not a plain tensor file ({type(err).__name__}); it was not "
                "loaded because unpickling it could run code") from None
        optimizer.load_state_dict(sd)
        return
    try:
        doc = json.loads(files["optimizer.json"])
        tensors = safetensors.torch.load(files["optimizer.safetensors"])
    except (ValueError, KeyError, safetensors.SafetensorError) as err:
        raise UnsafeCheckpointError(f"optimizer state is malformed: {err}") from None
    try:
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
        for idx, entry in doc.get("scalars", {}).items():
            state.setdefault(int(idx), {}).update({k: _unnumber(v) for k, v in entry.items()})
        live = optimizer.state_dict()["param_groups"]
        # JSON turns tuples (AdamW's betas) into lists: give each value its live type back.
        groups = [{k: tuple(_unnumber(v)) if isinstance(cur.get(k), tuple) else _unnumber(v)
                   for k, v in g.items()}
                  for g, cur in zip(doc["param_groups"], live, strict=True)]
        state = dict(sorted(state.items()))  # safetensors sorts keys as text: "10" < "2"
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
        raise UnsafeCheckpointError(f"optimizer state is malformed: {err}") from None


def rng_files() -> dict[str, bytes]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    doc = {"numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
           "python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    return {"rng.safetensors": safetensors.torch.save({"torch": torch.get_rng_state()}),
            "rng.json": _json(doc)}


def load_rng(files: dict[str, bytes]) -> None:
    if "rng.json" not in files:
        if "rng.pt" in files:
            raise UnsafeCheckpointError(
                "rng.pt is a pickle (checkpoints of older rollart versions store RNG state that "
                "way); it is not loaded because unpickling it could run code. Resume from a "
                "checkpoint written by this version, or start the run afresh")
        raise UnsafeCheckpointError("checkpoint has no RNG state")
    try:
        doc = json.loads(files["rng.json"])
        torch_state = safetensors.torch.load(files["rng.safetensors"])["torch"]
        n, p = doc["numpy"], doc["python"]
        np_state = (str(n["kind"]), np.array(n["keys"], dtype=np.uint32), int(n["pos"]),
                    int(n["has_gauss"]), float(n["cached_gaussian"]))
        gauss = p["gauss_next"]
        py_state = (int(p["version"]), tuple(int(x) for x in p["state"]),
                    None if gauss is None else float(gauss))
    except (ValueError, KeyError, TypeError, safetensors.SafetensorError) as err:
        raise UnsafeCheckpointError(f"RNG state is malformed: {err}") from None
    if torch_state.dtype != torch.uint8 or torch_state.dim() != 1:
        raise UnsafeCheckpointError("RNG state is malformed: torch state must be a uint8 vector")
    try:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
    except (ValueError, TypeError, RuntimeError) as err:
        raise UnsafeCheckpointError(f"RNG state is malformed: {err}") from None
