"""benchmarks/checkpoint_snapshot.py: its summary against hand-computed values, and the packed
tensor files against the files the previous code wrote (the same bytes)."""

from __future__ import annotations

import torch

from benchmarks.checkpoint_snapshot import previous_files, summarise
from rollart.config import AlgoConfig, TinyModelConfig, TrainConfig
from rollart.models.policy import build_tiny_model
from rollart.models.tokenizer import build_tokenizer
from rollart.train.trainer import Trainer


def _m(snapshot: float, write: float) -> dict[str, float]:
    return {"snapshot_s": snapshot, "write_s": write, "total_s": snapshot + write}


def test_summary_takes_medians_and_pairs_the_rounds():
    rounds = [{"packed": _m(2.0, 1.0), "previous": _m(20.0, 10.0)},
              {"packed": _m(4.0, 1.0), "previous": _m(12.0, 8.0)},
              {"packed": _m(1.0, 2.0), "previous": _m(15.0, 9.0)}]
    s = summarise(rounds)
    assert s["packed_snapshot_s_median"] == 2.0 and s["previous_snapshot_s_median"] == 15.0
    assert s["packed_write_s_median"] == 1.0 and s["previous_total_s_median"] == 24.0
    assert s["snapshot_s_ratio_per_round"] == [10.0, 3.0, 15.0]
    assert s["snapshot_s_ratio_median"] == 10.0
    assert s["total_s_ratio_per_round"] == [10.0, 4.0, 8.0]
    assert s["total_s_ratio_median"] == 8.0


def test_packed_files_are_the_bytes_the_previous_code_wrote():
    torch.manual_seed(0)
    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, 300)
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    tr = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=0)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    model(input_ids=ids).logits.mean().backward()
    tr.optimizer.step()  # the AdamW moments exist
    packed, before = tr.checkpoint_files(), previous_files(tr)
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert packed[name] == before[name], name
