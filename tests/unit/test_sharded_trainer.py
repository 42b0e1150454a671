"""Trainer ranks (`train.world_size` > 1): how rows are shared, how the loss is normalised
across ranks, and that a 2-rank FSDP2 update equals the 1-rank update on the same batch.

The 2-rank run is two real processes meeting over gloo (`rollart.train.rank_check`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rollart.config import ConfigError, load_config
from rollart.train.distributed import partition_by_tokens, plan_rows
from rollart.train.rank_check import launch, run_rank, tiny_model
from rollart.train.trainer import micro_weight


def test_rows_are_shared_by_tokens_longest_first():
    # lengths 10, 6, 6, 4, 2 over 2 ranks: 10 -> r0; 6 -> r1; 6 -> r1 (6 < 10); 4 -> r0
    # (10 < 12); 2 -> r1 (12 < 14): r0 holds rows 0, 3 (14 tokens), r1 rows 1, 2, 4 (14).
    assert partition_by_tokens([10, 6, 6, 4, 2], 2) == [[0, 3], [1, 2, 4]]
    # More ranks than rows: the last rank gets nothing, and pads every micro-batch.
    assert partition_by_tokens([5, 3], 3) == [[0], [1], []]
    assert plan_rows([5, 3], 3, 2, size=4) == [[]]
    # Micro-batches of 2 rows: r1 has two, so r0 runs its one and a padding one.
    assert plan_rows([10, 6, 6, 4, 2], 2, 0, size=2) == [[0, 3], []]
    assert plan_rows([10, 6, 6, 4, 2], 2, 1, size=2) == [[1, 2], [4]]


def test_micro_weights_normalise_over_the_whole_batch():
    """Model tokens per row 4, 3, 2, 2, 1 (12 in all, 5 sequences), shared as above. Token
    mean: r0's micro-batch [0, 3] weighs (4 + 2) / 12, r1's [1, 2] (3 + 2) / 12 and [4] 1 / 12;
    a sequence mean counts sequences: 2 / 5, 2 / 5, 1 / 5. Either way the shares sum to 1."""
    tokens = [4, 3, 2, 2, 1]
    mask = torch.zeros(5, 6)
    for i, n in enumerate(tokens):
        mask[i, :n] = 1.0

    def w(rows: list[int], agg: str) -> float:
        return micro_weight(mask[rows], 12.0, 5.0, agg)

    assert w([0, 3], "token_mean") == pytest.approx(6 / 12)
    assert w([1, 2], "token_mean") == pytest.approx(5 / 12)
    assert w([4], "token_mean") == pytest.approx(1 / 12)
    assert w([0, 3], "seq_mean_token_mean") == pytest.approx(2 / 5)
    assert w([4], "seq_mean_token_sum") == pytest.approx(1 / 5)


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory):
    """The same 3 updates (a tiny Llama saved as a model directory, 12 rows of 2 generated
    turns in 3 groups, the last with advantage 0, lr 1e-3) on 1 rank (this process; the
    model loaded whole) and on 2 ranks (two processes; each builds the model without weights
    and reads only its shards)."""
    out = tmp_path_factory.mktemp("ranks")
    model_dir = out / "tiny-hf"
    tiny_model(0).save_pretrained(model_dir, safe_serialization=True)
    kw = dict(updates=3, rows=12, lr=1e-3, micro=4, max_len=60, seed=0, uniform_groups=1)
    (out / "w1").mkdir()
    threads = torch.get_num_threads()
    try:
        run_rank(0, 1, 0, out / "w1", str(model_dir), **kw)
    finally:
        torch.set_num_threads(threads)
    launch(2, out / "w2", model=str(model_dir), **kw)
    return out, kw


def _params(d) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(d / "params.safetensors"))


def test_two_rank_update_equals_the_one_rank_update(one_and_two_ranks):
    """Weights after 3 updates agree to within what float reduction order allows; the loss
    and the gradient norm (which a wrong normalisation across ranks, e.g. a rank's own token
    count, or FSDP's averaging left uncorrected, would change) agree to float precision.

    Tolerance, from the arithmetic: the two runs sum the same terms in another order, so a
    gradient element differs by a few float32 ulps of the sum of its terms' magnitudes; where
    terms cancel that may even flip its sign. AdamW's step per element is lr * m_hat /
    (sqrt(v_hat) + eps), and |m_hat / sqrt(v_hat)| <= 1.003 for the first 3 steps (Cauchy-
    Schwarz over the bias-corrected averages, beta1 0.9, beta2 0.999); so two runs differ by
    at most 2 * 1.003 * lr per element per step: 3 steps at lr 1e-3 -> 6.02e-3. The loss
    and the pre-clip gradient norm are sums of ~100 float32 terms: 1e-4 relative.

    Both leave the 4 rows without signal out of their passes (`train/rows_left_out`): the
    ranks pick the same rows and share them, and the normalisers stay the whole batch's."""
    out, kw = one_and_two_ranks
    a, b = _params(out / "w1"), _params(out / "w2")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 2 * 1.003 * kw["lr"] * kw["updates"]
    m1 = json.loads((out / "w1" / "metrics.json").read_text())["metrics"]
    m2 = json.loads((out / "w2" / "metrics.json").read_text())["metrics"]
    for one, two in zip(m1, m2, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/logprob_mismatch",
                    "train/is_ratio_mean", "train/tokens", "train/sequences"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
        assert one["train/rows_left_out"] == two["train/rows_left_out"] == 4


def test_each_rank_holds_about_half_the_state(one_and_two_ranks):
    """Parameters, gradients and optimizer state counted from each rank's own tensors: a
    rank of two holds half (dim-0 shards; a row count that does not split evenly leaves one
    row's worth more on a rank)."""
    out, _ = one_and_two_ranks
    one = json.loads((out / "w1" / "rank0.json").read_text())["held_bytes"]["total"]
    for r in (0, 1):
        held = json.loads((out / "w2" / f"rank{r}.json").read_text())["held_bytes"]["total"]
        assert held / one <= 0.55


def test_world_size_larger_than_the_trainer_workers_is_refused():
    default = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    with pytest.raises(ConfigError, match="train.world_size"):
        load_config(default, ["train.world_size=2"])
    cfg = load_config(default, ["train.world_size=2", "cluster.workers.H800=2"])
    assert cfg.train.world_size == 2


def test_shardings_a_machine_or_model_cannot_take_are_refused(tmp_path):
    """Tensor parallelism without CUDA, and a model whose layers the trainer cannot shard:
    one line naming the key, before anything starts."""
    default = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="engine.vllm.tensor_parallel_size"):
            load_config(default, ["engine.vllm.tensor_parallel_size=2"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    sharded = ["train.world_size=2", "cluster.workers.H800=2", "model.source=hf_dir",
               f"model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="train.world_size > 1 shards the model"):
        load_config(default, sharded)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert load_config(default, sharded).train.world_size == 2
