"""Weight sync through a shared-memory file: exact bytes, ties stored once, in-place republish,
and a clean refusal where the file cannot be mapped (another host)."""

from __future__ import annotations

import safetensors.torch
import torch

from rollart.engines.shared_weights import SharedWeightsWriter, host_id, read_shared
from rollart.engines.weight_stream import WeightReceiver, send_weights
from rollart.runner.stages import push_weights
from rollart.storage.weights import serialize_weights


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


def test_adopted_parameters_live_in_the_file_and_publish_copies_nothing(tmp_path):
    """After adopt, a trained step is visible to a reader without a copy; tied parameters stay
    tied; gradients and the optimizer keep working on the moved parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 7))
    model[1].weight = model[0].weight  # tied, like an LM head
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    w = SharedWeightsWriter(tmp_path / "w.bin")
    w.adopt(model)
    assert model[1].weight is model[0].weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # same values, new home
    reader = read_shared(w.publish(1, model.state_dict()))
    assert reader is not None
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, before["0.weight"])
    # the reader's views of the file see the step: the parameters are the file
    assert torch.equal(reader["0.weight"], model[0].weight.detach())
    assert torch.equal(reader["1.weight"], model[0].weight.detach())
    desc = w.publish(2, model.state_dict())  # nothing to copy; the descriptor as before
    assert desc["bytes"] == (7 * 5 + 7) * 4 and desc["version"] == 2
    again = read_shared(desc)
    assert again is not None and torch.equal(again["0.weight"], model[0].weight.detach())
    # Every parameter now shares the file's storage: ties are told apart by data pointer, so a
    # checkpoint still holds each distinct tensor (a storage-pointer test kept only one).
    saved = safetensors.torch.load(serialize_weights(model.state_dict()))
    assert sorted(saved) == ["0.weight", "1.bias"]
    assert torch.equal(saved["1.bias"], model[1].bias.detach())


def test_another_host_gets_none(tmp_path):
    desc = SharedWeightsWriter(tmp_path / "w.bin").publish(1, _state())
    assert read_shared({**desc, "host": "elsewhere:boot"}) is None


class _Trainer:
    def __init__(self, path) -> None:
        self.writer, self.state, self.exports = SharedWeightsWriter(path), _state(), 0
        self.streams: list[list] = []

    def shared_memory_sync(self) -> bool:
        return True

    def sync_via_store(self) -> bool:
        return False

    def share_weights(self):
        return self.writer.publish(7, self.state)

    def export_weights(self):
        self.exports += 1
        return 7, self.state

    def stream_weights(self, chain, token, timeout_s):
        self.streams.append(list(chain))
        return {**send_weights(chain, token, 7, self.state, timeout_s=timeout_s), "version": 7}


class _Engine:
    def __init__(self, same_host: bool) -> None:
        self.same_host, self.loaded, self.rx = same_host, None, None

    def load_shared_weights(self, desc):
        state = read_shared(desc if self.same_host else {**desc, "host": "x"})
        if state is None:
            return None
        return self.update_weights(desc["version"], state)

    def update_weights(self, version, state):
        self.loaded = (version, {k: v.clone() for k, v in state.items()})
        return {"pause_s": 0.0}

    def open_weight_stream(self, token, timeout_s):
        self.rx = WeightReceiver("127.0.0.1", token, timeout_s)
        return self.rx.address

    def finish_weight_stream(self, timeout_s):
        version, state, _ = self.rx.result(timeout_s)
        self.rx.close()
        return self.update_weights(version, state)


def test_push_weights_uses_shm_on_host_and_streams_to_the_others(tmp_path):
    """The engine on the trainer's host maps its file; the two elsewhere get one stream from
    the trainer, through them both (a chain), and nothing goes through the caller: the
    trainer never exports its weights to it."""
    trainer = _Trainer(tmp_path / "w.bin")
    local, far1, far2 = _Engine(True), _Engine(False), _Engine(False)
    out = push_weights(trainer, [local, far1, far2])
    assert out["version"] == 7 and out["metrics"]["perf/sync_shm_engines"] == 1.0
    assert out["metrics"]["perf/sync_stream_engines"] == 2.0
    assert trainer.exports == 0
    assert trainer.streams == [[far1.rx.address, far2.rx.address]]
    for e in (local, far1, far2):
        assert e.loaded is not None and e.loaded[0] == 7
        assert all(torch.equal(e.loaded[1][k], v) for k, v in trainer.state.items())
