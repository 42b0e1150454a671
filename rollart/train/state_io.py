"""Optimizer and RNG state in formats that cannot run code when loaded.

A checkpoint comes back from the store, which other people (or a compromised job) can write:
a pickle there runs arbitrary code on `--resume`. So nothing here unpickles:

- optimizer: every tensor of `optimizer.state_dict()["state"]` in `optimizer.safetensors`
  (`state.{param index}.{name}`), the rest (param groups, non-tensor per-parameter values) in
  `optimizer.json`;
- RNG: torch's generator state (a uint8 tensor) in `rng.safetensors`; numpy's MT19937 state and
  Python's `random` state in `rng.json`;
- the engines' sampling generators: one uint8 tensor per replica (`replica.{i}`, empty for a
  replica that recorded none) in `engine_rng.safetensors`.

JSON is written with sorted keys and floats in repr form, so an exact resume writes the same
bytes as an uninterrupted run. The pickles of older versions are never loaded, not even by
torch's restricted unpickler (`weights_only=True` is a smaller pickle VM, still a pickle VM, and
its refusals end a resume with a long traceback): `optimizer.pt` and `rng.pt` refuse the
checkpoint with a one-line `UnsafeCheckpointError` (the resume skips such checkpoints before
this: rollart/storage/formats.py), and an older `engine_rng.pt` is not read: the engines of a
resume from it sample from a fresh seed, with one warning line (`engine_rng_state`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import Tensor

from rollart.storage.blob import Blob, as_bytes
from rollart.train.safetensors_pack import pack

ENGINE_RNG = "engine_rng.safetensors"
LEGACY_ENGINE_RNG = "engine_rng.pt"
SAFE_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json",
              ENGINE_RNG)
LEGACY_FILES = ("optimizer.pt", "rng.pt", LEGACY_ENGINE_RNG)


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


def optimizer_files(optimizer: torch.optim.Optimizer) -> dict[str, Blob]:
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
    return {"optimizer.safetensors": pack(tensors),
            "optimizer.json": _json({"param_groups": groups, "scalars": scalars})}


def load_optimizer(optimizer: torch.optim.Optimizer, files: Mapping[str, Blob]) -> None:
    if "optimizer.json" not in files:
        if "optimizer.pt" in files:
            raise UnsafeCheckpointError(
                "optimizer.pt is a pickle (checkpoints of older rollart versions store optimizer "
                "state that way); it is not loaded because unpickling it could run code. Resume "
                "from a checkpoint written by this version, or start the run afresh")
        raise UnsafeCheckpointError("checkpoint has no optimizer state")
    try:
        doc = json.loads(as_bytes(files["optimizer.json"]))
        tensors = safetensors.torch.load(as_bytes(files["optimizer.safetensors"]))
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


def load_rng(files: Mapping[str, Blob]) -> None:
    if "rng.json" not in files:
        if "rng.pt" in files:
            raise UnsafeCheckpointError(
                "rng.pt is a pickle (checkpoints of older rollart versions store RNG state that "
                "way); it is not loaded because unpickling it could run code. Resume from a "
                "checkpoint written by this version, or start the run afresh")
        raise UnsafeCheckpointError("checkpoint has no RNG state")
    try:
        doc = json.loads(as_bytes(files["rng.json"]))
        torch_state = safetensors.torch.load(as_bytes(files["rng.safetensors"]))["torch"]
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


def engine_rng_files(states: list[bytes]) -> dict[str, bytes]:
    """The engines' sampling generator states (one per replica; b"" for none) as safetensors."""
    tensors = {f"replica.{i}": (torch.frombuffer(bytearray(state), dtype=torch.uint8).clone()
                                if state else torch.zeros(0, dtype=torch.uint8))
               for i, state in enumerate(states)}
    return {ENGINE_RNG: safetensors.torch.save(tensors)}


def engine_rng_state(files: dict[str, bytes], replica: int) -> bytes | None:
    """Replica `replica`'s sampling generator state, or None when the checkpoint recorded none
    for it. Raises UnsafeCheckpointError (one line) for an older `engine_rng.pt` (a pickle: not
    read) or a malformed file."""
    if ENGINE_RNG not in files:
        if LEGACY_ENGINE_RNG in files:
            raise UnsafeCheckpointError(
                "engine_rng.pt is a pickle (checkpoints of older rollart versions store the "
                "engines' RNG that way); it is not loaded because unpickling it could run code")
        return None
    try:
        tensors = safetensors.torch.load(files[ENGINE_RNG])
    except (ValueError, safetensors.SafetensorError) as err:
        raise UnsafeCheckpointError(f"{ENGINE_RNG} is malformed: "
                                    f"{' '.join(str(err).split())}") from None
    state = tensors.get(f"replica.{replica}")
    if state is None or state.numel() == 0:
        return None
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise UnsafeCheckpointError(f"{ENGINE_RNG} is malformed: replica.{replica} must be a "
                                    "uint8 vector")
    return state.numpy().tobytes()
