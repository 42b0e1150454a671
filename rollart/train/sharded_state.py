"""A sharded trainer's checkpoint: torch.distributed.checkpoint in its safetensors layout.

Each rank writes the shards it holds of the policy, the reference and the optimizer state
(`dcp.save` with `HuggingFaceStorageWriter(save_distributed=True)`: one safetensors file per
rank, `dcp/shard-{rank+1:05d}-model-00001-of-00001.safetensors`, each carrying in its header
where its pieces sit in the full tensors). Nothing in it is a pickle: DCP's own `.metadata` file
is one, so its default layout is not used. Loading (`dcp.load` with `HuggingFaceStorageReader`)
reads the pieces every rank needs at its own world size, so a checkpoint saved by 2 ranks
resumes on 1 or 3. Parameter names are the trainer's `policy` (`TokenLogits`) names at every
world size; a tied weight is stored once (under the name `named_parameters` gives it).

The files go through the run store like every other checkpoint file (manifest with sizes and
CRC32s, written last by rank 0; `rollart/storage/checkpointing.py`).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from rollart.train.trainer import Trainer

DCP_PREFIX = "dcp/"
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def is_sharded_checkpoint(names: list[str] | set[str]) -> bool:
    return any(n.startswith(DCP_PREFIX) for n in names)


def _stored_keys(module: torch.nn.Module) -> set[str]:
    """Names of the parameters (a tied one once) and buffers; a state dict holds only the
    persistent buffers, so intersecting with its keys leaves out the tied copies alone."""
    return {k for k, _ in module.named_parameters()} | {k for k, _ in module.named_buffers()}


def _model_tensors(module: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
    keep = _stored_keys(module)
    return {f"{prefix}{k}": v for k, v in get_model_state_dict(module).items() if k in keep}


def state_tensors(trainer: Trainer) -> dict[str, Tensor]:
    """Every tensor of the trainer's state, this rank's shards of it (DTensors when sharded):
    `model/...`, `optim/...` (flattened: `state.{name}.exp_avg`, ...), `ref/...`."""
    out = _model_tensors(trainer.policy, "model/")
    osd = get_optimizer_state_dict(trainer.policy, trainer.optimizer, options=_OPTIM)
    out.update({f"optim/{k}": v for k, v in osd.items() if isinstance(v, Tensor)})
    if trainer.ref_policy is not None:
        out.update(_model_tensors(trainer.ref_policy, "ref/"))
    return out


def save_shards(trainer: Trainer) -> dict[str, bytes]:
    """This rank's checkpoint files {`dcp/<name>`: bytes}. A collective: every rank calls it."""
    with tempfile.TemporaryDirectory(prefix="rollart-dcp-") as tmp:
        dcp.save(state_tensors(trainer),
                 storage_writer=dcp.HuggingFaceStorageWriter(path=tmp, save_distributed=True))
        return {DCP_PREFIX + p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())
                if p.is_file()}


def _load_into(template: dict[str, Tensor], files: dict[str, bytes], one_process: bool) -> None:
    """`one_process`: this process reads alone (no collective), even where a group exists."""
    with tempfile.TemporaryDirectory(prefix="rollart-dcp-") as tmp:
        for name, data in files.items():
            if name.startswith(DCP_PREFIX):
                (Path(tmp) / Path(name).name).write_bytes(data)
        with warnings.catch_warnings():  # "assuming ... a single process": as meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(template, storage_reader=dcp.HuggingFaceStorageReader(path=tmp),
                     no_dist=one_process)


def load_shards(trainer: Trainer, files: dict[str, bytes]) -> None:
    """Fill the trainer's model, optimizer and reference from a sharded checkpoint's files, at
    this trainer's world size (every rank calls it). Optimizer hyper-parameters are the run
    config's (as the resume guard requires them to be)."""
    template = state_tensors(trainer)  # the optimizer state exists (zeros) once asked for
    _load_into(template, files, one_process=not trainer.ranks.sharded)
    strict = StateDictOptions(strict=False)  # the tied head comes back through its tie
    set_model_state_dict(trainer.policy, {k[len("model/"):]: v for k, v in template.items()
                                          if k.startswith("model/")}, options=strict)
    groups = {k: v for k, v in get_optimizer_state_dict(trainer.policy, trainer.optimizer,
                                                        options=_OPTIM).items()
              if not isinstance(v, Tensor)}
    optim = {k[len("optim/"):]: v for k, v in template.items() if k.startswith("optim/")}
    set_optimizer_state_dict(trainer.policy, trainer.optimizer, {**optim, **groups},
                             options=_OPTIM)
    if trainer.ref_policy is not None:
        set_model_state_dict(trainer.ref_policy, {k[len("ref/"):]: v for k, v in template.items()
                                                  if k.startswith("ref/")}, options=strict)


def load_pretrained(trainer: Trainer, model_dir: str) -> None:
    """A sharded trainer built on a skeleton (`policy_skeleton`): every rank reads its own
    pieces of the model directory's safetensors files (DCP's reader plans the reads per
    shard), for the policy and the reference; then the buffers that are computed, not stored
    (rotary frequencies), are computed again. Every rank calls it."""
    strict = StateDictOptions(strict=False)  # the tied head comes back through its tie
    for policy in (trainer.policy, trainer.ref_policy):
        if policy is None:
            continue
        keep = _stored_keys(policy)
        hf_names = {k[len("model."):]: v for k, v in get_model_state_dict(policy).items()
                    if k in keep}  # the file's names: the causal LM's own
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(hf_names, storage_reader=dcp.HuggingFaceStorageReader(path=model_dir),
                     no_dist=not trainer.ranks.sharded)
        set_model_state_dict(policy, {f"model.{k}": v for k, v in hf_names.items()},
                             options=strict)
        _recompute_buffers(policy.model, trainer.device)


def _recompute_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers are not in a checkpoint: a rotary embedding's are computed from
    the config, so it is built again. Any other such buffer is a model this does not know."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, type(mod)(config=mod.config).to(device))
        elif getattr(mod, "_non_persistent_buffers_set", None):
            raise ValueError(f"{type(mod).__name__} ({name}) has computed buffers a sharded "
                             "trainer cannot rebuild: use train.world_size=1")


def full_model_state(model: torch.nn.Module, files: dict[str, bytes]) -> dict[str, Tensor]:
    """The policy's full weights from a sharded checkpoint, for one process that holds the
    whole model (an engine serving a checkpoint): names as `model.state_dict()`'s."""
    from rollart.train.batch import TokenLogits

    wrapper = TokenLogits(model)
    keep = _stored_keys(wrapper)
    template = {f"model/{k}": v.detach().clone() for k, v in wrapper.state_dict().items()
                if k in keep}
    _load_into(template, files, one_process=True)
    return {k[len("model/model."):]: v for k, v in template.items()}
