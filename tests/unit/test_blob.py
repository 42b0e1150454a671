"""Checkpoint tensor files packed straight into aligned chunks (rollart/train/safetensors_pack.py)
and written to disk without a page-cache copy (rollart/storage/blob.py, files.atomic_write)."""

import os

import pytest
import safetensors.torch
import torch

import rollart.storage.files as files_mod
from rollart.storage.blob import ALIGN, ChunkedBytes, as_bytes
from rollart.storage.files import atomic_write
from rollart.storage.integrity import digests
from rollart.storage.store import RunStore
from rollart.train.safetensors_pack import pack


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.big": torch.randn(700, 9, generator=g),            # 25,200 bytes: spans chunks
        "ids": torch.arange(1500),                             # int64
        "scalar": torch.tensor(2.5),                           # shape []
        "mask": torch.tensor([True, False, True]),             # bool
        "empty": torch.zeros(0, 4),                            # no bytes
        "t": torch.randn(30, 20, generator=g).t(),             # not contiguous
        "half": torch.randn(77, generator=g).to(torch.bfloat16),
        "a": torch.ones(5, dtype=torch.float16),
    }


@pytest.mark.parametrize("chunk", [ALIGN, 3 * ALIGN, 1 << 20])
def test_pack_writes_the_bytes_safetensors_writes(chunk):
    tensors = _tensors()
    want = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})
    got = pack(tensors, chunk=chunk)
    assert len(got) == len(want)
    assert bytes(got) == want and got == want  # header, layout order, padding, data
    assert len(got.chunks) == -(-len(want) // chunk)
    back = safetensors.torch.load(as_bytes(got))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_chunked_bytes_slices_compares_and_digests_like_bytes():
    data = os.urandom(5 * ALIGN + 123)
    blob = ChunkedBytes(len(data), ALIGN)
    blob.write_at(0, torch.frombuffer(bytearray(data[:7000]), dtype=torch.uint8))
    blob.write_at(7000, torch.frombuffer(bytearray(data[7000:]), dtype=torch.uint8))
    for a, b in [(0, len(data)), (ALIGN - 1, ALIGN + 1), (100, 3 * ALIGN + 5), (len(data) - 3,
                                                                                 None)]:
        assert blob[a:b] == data[a:b]
    assert blob == data and blob != data[:-1] and blob != data[:-1] + b"\0"
    assert digests(blob) == digests(data)
    with pytest.raises(TypeError):
        hash(blob)
    with pytest.raises(ValueError, match="multiple"):
        ChunkedBytes(10, ALIGN + 1)


@pytest.mark.parametrize("direct", [True, False])
def test_atomic_write_of_chunks_leaves_exactly_the_bytes(tmp_path, monkeypatch, direct):
    """O_DIRECT pads the last chunk to a whole block and cuts the file back; without it (a
    filesystem that refuses the flag), the page-cache write gives the same file."""
    if not direct:
        monkeypatch.setattr(files_mod, "_open_direct", lambda path: None)
    data = os.urandom(2 * ALIGN + 77)
    blob = ChunkedBytes(len(data), ALIGN)
    blob.write_at(0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    path = tmp_path / "d" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"old")
    atomic_write(str(path), blob)
    assert path.read_bytes() == data
    assert sorted(os.listdir(path.parent)) == ["model.safetensors"]  # no temporary left


def test_a_checkpoint_of_chunks_round_trips_through_the_store(tmp_path):
    tensors = _tensors()
    store = RunStore(str(tmp_path), "run")
    store.save_checkpoint(1, {"model.safetensors": pack(tensors, chunk=ALIGN), "x.json": b"{}"},
                          {"iteration": 0})
    files, manifest = store.load_checkpoint(1)
    want = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})
    assert files["model.safetensors"] == want
    assert manifest["files"]["model.safetensors"] == digests(want)
