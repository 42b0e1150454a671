"""Weight sync through a shared-memory file: exact bytes, ties stored once, in-place republish,
and a clean refusal where the file cannot be mapped (another host)."""

from __future__ import annotations

import torch

from rollart.engines.shared_weights import SharedWeightsWriter, host_id, read_shared
from rollart.stages import push_weights


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(7, 5, generator=g)
    return {"embed.weight": emb, "norm.weight": torch.randn(5, generator=g),
            "step": torch.tensor(3, dtype=torch.int64), "lm_head.weight": emb}  # tied


def test_publish_then_read_is_exact_and_ties_are_stored_once(tmp_path):
    w = SharedWeightsWriter(tmp_path / "w.bin")
    state = _state()
    desc = w.publish(4, state)
    assert desc["version"] == 4 and desc["host"] == host_id()
    assert desc["bytes"] == (7 * 5 + 5) * 4 + 8  # the tied matrix once
    got = read_shared(desc)
    assert got is not None and list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    offsets = {name: off for name, _, _, off in desc["layout"]}
    assert offsets["embed.weight"] == offsets["lm_head.weight"]
    assert all(off % 64 == 0 for off in offsets.values())


def test_republish_rewrites_the_same_file_in_place(tmp_path):
    w = SharedWeightsWriter(tmp_path / "w.bin")
    state = _state()
    first = read_shared(w.publish(1, state))
    state["norm.weight"].add_(1.0)
    desc = w.publish(2, state)
    assert first is not None and torch.equal(first["norm.weight"], state["norm.weight"])
    assert desc["version"] == 2
    w.close()
    assert not (tmp_path / "w.bin").exists()
    assert read_shared(desc) is None  # file gone: the caller sends tensors instead


def test_another_host_gets_none(tmp_path):
    desc = SharedWeightsWriter(tmp_path / "w.bin").publish(1, _state())
    assert read_shared({**desc, "host": "elsewhere:boot"}) is None


class _Trainer:
    def __init__(self, path) -> None:
        self.writer, self.state, self.exports = SharedWeightsWriter(path), _state(), 0

    def shared_memory_sync(self) -> bool:
        return True

    def sync_via_store(self) -> bool:
        return False

    def share_weights(self):
        return self.writer.publish(7, self.state)

    def export_weights(self):
        self.exports += 1
        return 7, self.state


class _Engine:
    def __init__(self, same_host: bool) -> None:
        self.same_host, self.loaded = same_host, None

    def load_shared_weights(self, desc):
        state = read_shared(desc if self.same_host else {**desc, "host": "x"})
        if state is None:
            return None
        return self.update_weights(desc["version"], state)

    def update_weights(self, version, state):
        self.loaded = (version, {k: v.clone() for k, v in state.items()})
        return {"pause_s": 0.0}


def test_push_weights_uses_shm_on_host_and_sends_tensors_elsewhere(tmp_path):
    trainer = _Trainer(tmp_path / "w.bin")
    local, remote = _Engine(True), _Engine(False)
    out = push_weights(trainer, [local, remote])
    assert out["version"] == 7 and out["metrics"]["perf/sync_shm_engines"] == 1.0
    assert trainer.exports == 1  # only for the engine that could not map the file
    for e in (local, remote):
        assert e.loaded is not None and e.loaded[0] == 7
        assert all(torch.equal(e.loaded[1][k], v) for k, v in trainer.state.items())
