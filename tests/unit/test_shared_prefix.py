"""The shared-prefix forward gives the plain forward's hidden states, loss and gradients.

Tolerances: float32 with the same kernels but a different summation order (the prefix K/V
come from a batch-1 pass, the attention splits into a cached and a new part); values are O(1)
after RMSNorm, so 1e-5 absolute on states and 1e-4 relative on gradients is ~100 float32 ulps.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollart.train import shared_prefix
from rollart.train.shared_prefix import (
    common_prefix_len,
    groups_of,
    shared_prefix_hidden,
    suffix_buckets,
)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, list[str], list[int]]:
    """Two groups of 3 with a 10-token prompt each, answers of different lengths, right-padded
    with 0; one single-member group. loss_mask [B, T-1] marks predictions of answer tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = {"a": torch.randint(1, 50, (10,), generator=g),
               "b": torch.randint(1, 50, (12,), generator=g),
               "c": torch.randint(1, 50, (9,), generator=g)}
    rows, gids, lens = [], [], []
    for gid, n_ans in [("a", 5), ("b", 7), ("a", 3), ("b", 2), ("a", 6), ("b", 4), ("c", 5)]:
        ans = torch.randint(1, 50, (n_ans,), generator=g)
        rows.append((prompts[gid], torch.cat([prompts[gid], ans])))
        gids.append(gid)
    t = max(len(r) for _, r in rows)
    ids = torch.zeros((len(rows), t), dtype=torch.long)
    mask = torch.zeros((len(rows), t - 1))
    for i, (p, r) in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, len(p) - 1:len(r) - 1] = 1.0  # position j predicts token j+1 (an answer token)
        lens.append(len(r))
    return ids, mask, gids, lens


def test_groups_and_prefix_length():
    assert groups_of(["x", "y", "x", "z", "y"]) == [[0, 2], [1, 4], [3]]
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4]])
    assert common_prefix_len(ids, 4) == 2 and common_prefix_len(ids, 1) == 1
    assert common_prefix_len(ids[:1], 3) == 3 and common_prefix_len(ids, 0) == 0


@pytest.mark.parametrize("call_cost", [64, 0], ids=["one-suffix-call", "length-buckets"])
def test_hidden_loss_and_grads_match_the_plain_forward(monkeypatch, call_cost):
    # call cost 0: every length split pays, so the suffixes go in MAX_BUCKETS calls
    monkeypatch.setattr(shared_prefix, "CALL_COST_POSITIONS", call_cost)
    ids, mask, gids, lens = _batch()
    plain, shared = _model(), _model()
    h_plain = plain.model(input_ids=ids).last_hidden_state
    h_shared = shared_prefix_hidden(shared.model, ids, mask, gids, min_prefix=4)
    for i, n in enumerate(lens):  # real positions only (pads differ: never used)
        assert torch.allclose(h_plain[i, :n], h_shared[i, :n], atol=1e-5, rtol=0)

    def loss(model, hidden):
        sel = mask > 0
        logits = model.lm_head(hidden[:, :-1][sel])  # [N, V]
        return torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])

    lp, ls = loss(plain, h_plain), loss(shared, h_shared)
    assert torch.allclose(lp, ls, atol=1e-6, rtol=1e-6)
    lp.backward()
    ls.backward()
    for (name, a), b in zip(plain.named_parameters(), shared.parameters(), strict=True):
        scale = a.grad.abs().max().clamp_min(1e-8)
        assert (a.grad - b.grad).abs().max() / scale < 1e-4, name


def test_prefix_stops_before_the_first_trained_position():
    """A member whose answer starts earlier (its mask starts inside the others' prompt) caps
    the shared prefix there: its states still equal the plain forward's."""
    ids, mask, gids, lens = _batch()
    mask[0, 5:] = 1.0  # row 0 trained from position 5, inside group a's 10-token prompt
    model = _model()
    with torch.no_grad():
        h_plain = model.model(input_ids=ids).last_hidden_state
        h_shared = shared_prefix_hidden(model.model, ids, mask, gids, min_prefix=4)
    for i, n in enumerate(lens):
        assert torch.allclose(h_plain[i, :n], h_shared[i, :n], atol=1e-5, rtol=0)


def test_suffix_buckets_minimise_padded_positions_plus_call_cost(monkeypatch):
    """need = [31, 10, 30, 12] after a prefix of 8 (suffixes 23, 2, 22, 4 positions).
    Call cost 64: one call, 4 x 23 + 64 = 156, beats any split (two: 2 x 4 + 64 + 2 x 23 +
    64 = 182). Call cost 0: three calls; {10}, {12}, {30, 31}: 2 + 4 + 2 x 23 = 52 beats
    {10, 12}, {30}, {31}: 2 x 4 + 22 + 23 = 53."""
    need = [31, 10, 30, 12]
    assert suffix_buckets(need, 8) == [[1, 3, 2, 0]]
    monkeypatch.setattr(shared_prefix, "CALL_COST_POSITIONS", 0)
    assert suffix_buckets(need, 8) == [[1], [3], [2, 0]]
    assert suffix_buckets([9], 8) == [[0]]
