import math

import pytest
import torch

from rollart.algo.offpolicy import behaviour_weights, staleness_metrics


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_token_tis_truncates_and_ignores_masked():
    prox = _t([[-1.0, -1.0, -1.0]])
    mu = _t([[-1.5, -0.5, -9.0]])  # ratios e^0.5=1.6487, e^-0.5=0.6065, (masked) e^8
    mask = _t([[1.0, 1.0, 0.0]])
    w, m = behaviour_weights(prox, mu, mask, "tis", cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-0.5), 0.0], rel=1e-5)
    assert m["train/is_clipped_frac"] == pytest.approx(0.5)
    assert m["train/is_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert not w.requires_grad


def test_sequence_tis_uses_product_of_ratios():
    prox = _t([[-1.0, -1.0], [-1.0, -1.0]])
    mu = _t([[-1.2, -1.1], [-0.5, -1.0]])  # seq log-ratios 0.3 and -0.5
    mask = _t([[1.0, 1.0], [1.0, 1.0]])
    w, _ = behaviour_weights(prox, mu, mask, "tis_seq", cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.3)] * 2, rel=1e-5)
    assert w[1].tolist() == pytest.approx([math.exp(-0.5)] * 2, rel=1e-5)


def test_icepop_masks_tokens_outside_band():
    prox = _t([[0.0, 0.0, 0.0]])
    mu = _t([[-1.0, 0.1, 1.0]])  # ratios e^1=2.718 (out), 0.905 (in), e^-1=0.368 (out)
    w, m = behaviour_weights(prox, mu, torch.ones(1, 3), "icepop", low=0.5, high=2.0)
    assert w.tolist() == [[0.0, 1.0, 0.0]]
    assert m["train/is_clipped_frac"] == pytest.approx(2 / 3)


def test_none_mode_and_on_policy_identity():
    x = _t([[-0.3, -2.0]])
    w, m = behaviour_weights(x, x.clone(), torch.ones(1, 2), "none")
    assert w is None and m["train/is_ratio_mean"] == pytest.approx(1.0)
    w, _ = behaviour_weights(x, x.clone(), torch.ones(1, 2), "tis")
    assert w.tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="off-policy mode"):
        behaviour_weights(x, x, torch.ones(1, 2), "bogus")


def test_staleness_metrics_count_model_tokens_only():
    m = staleness_metrics([[-1, 3, 3], [-1, 1]], trainer_version=4)
    assert m["train/staleness_mean"] == pytest.approx((1 + 1 + 3) / 3)
    assert m["train/staleness_max"] == 3.0
