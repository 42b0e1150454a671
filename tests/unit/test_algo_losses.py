"""Policy loss, aggregation, KL and entropy against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rollart.algo import (
    POLICY_LOSSES,
    aggregate,
    compute_policy_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_k3,
    loss_hyperparams,
    masked_mean,
    masked_sum,
    ppo_clip,
    register_loss,
    select_loss_params,
    token_logprobs,
)

torch.set_num_threads(1)


def _one_token(adv: float, ratio: float, **kw):
    """Single sequence, single token; returns (loss, metrics, d loss / d logprobs)."""
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, metrics = ppo_clip(logp, old, torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), metrics, logp.grad.item()


@pytest.mark.parametrize(
    "adv, ratio, expected, clipped",
    [
        (1.0, 1.1, -1.1, False),  # inside [0.8, 1.2]: -A * ratio
        (1.0, 1.5, -1.2, True),  # A > 0, ratio above 1.2: clipped to -1.2
        (-1.0, 0.5, 0.8, True),  # A < 0, ratio below 0.8: clipped to 0.8
        (1.0, 0.5, -0.5, False),  # A > 0, low ratio: pessimistic branch is unclipped
        (-1.0, 1.5, 1.5, False),  # A < 0, high ratio: unclipped (no dual clip)
        (-2.0, 1.1, 2.2, False),
    ],
)
def test_ppo_clip_single_token(adv, ratio, expected, clipped):
    loss, metrics, grad = _one_token(adv, ratio)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac"] == (1.0 if clipped else 0.0)
    assert metrics["ratio_mean"] == pytest.approx(ratio, rel=1e-6)
    # d(-A * exp(logp - old))/d logp = -A * ratio when unclipped; exactly 0 when clipped
    assert grad == (0.0 if clipped else pytest.approx(-adv * ratio, rel=1e-5))


def test_ppo_clip_asymmetric_clip_higher():
    loss, metrics, grad = _one_token(1.0, 1.25, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25) and metrics["clip_frac"] == 0.0 and grad != 0.0
    loss, metrics, grad = _one_token(1.0, 1.5, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.28) and metrics["clip_frac"] == 1.0 and grad == 0.0


def test_dual_clip():
    # A < 0, ratio 5: standard loss max(5, 1.2) = 5, dual clip caps it at -A * 3 = 3, zero grad
    loss, metrics, grad = _one_token(-1.0, 5.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert metrics["dual_clip_frac"] == 1.0 and metrics["clip_frac"] == 0.0
    # A < 0, ratio 2: below the cap, unchanged (loss 2, grad -A * ratio = 2)
    loss, metrics, grad = _one_token(-1.0, 2.0, dual_clip=3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0, rel=1e-5)
    assert metrics["dual_clip_frac"] == 0.0
    # A > 0: dual clip never applies; ratio 5 -> standard clip -1.2
    loss, metrics, _ = _one_token(1.0, 5.0, dual_clip=3.0)
    assert loss == pytest.approx(-1.2) and metrics["dual_clip_frac"] == 0.0
    # without dual clip, A < 0 ratio 5 -> 5
    assert _one_token(-1.0, 5.0)[0] == pytest.approx(5.0)
    with pytest.raises(ValueError):
        _one_token(-1.0, 5.0, dual_clip=0.5)


def _batch():
    """3 sequences of different lengths; seq 1 has masked tokens with a huge ratio, seq 2 none.

    per-token losses (all inside the clip range):
      seq 0, A=+1, ratios [1.1, 1.0, 1.05] -> [-1.1, -1.0, -1.05], token mean -1.05
      seq 1, A=-1, ratios [0.9, e^100 masked, e^100 masked] -> [0.9], token mean 0.9
      seq 2, A=+5, no masked tokens -> excluded
    """
    old = torch.full((3, 3), -2.0)
    log_r = torch.tensor(
        [[math.log(1.1), 0.0, math.log(1.05)], [math.log(0.9), 100.0, 100.0], [3.0, 3.0, 3.0]]
    )
    logp = (old + log_r).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 5.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    return logp, old, adv, mask


def test_aggregations_differ_and_masked_tokens_ignored():
    logp, old, adv, mask = _batch()
    loss_seq, m = ppo_clip(logp, old, adv, mask, loss_agg="seq_mean_token_mean")
    # (-1.05 + 0.9) / 2 = -0.075 ; an empty seq 2 counted as 0 would give -0.05
    assert loss_seq.item() == pytest.approx(-0.075, abs=1e-6)
    loss_tok, m_tok = ppo_clip(logp, old, adv, mask, loss_agg="token_mean")
    # (-1.1 - 1.0 - 1.05 + 0.9) / 4 = -0.5625
    assert loss_tok.item() == pytest.approx(-0.5625, abs=1e-6)
    # metrics only see the 4 masked tokens
    assert m == m_tok
    assert m["clip_frac"] == 0.0
    assert m["ratio_max"] == pytest.approx(1.1, rel=1e-6)
    assert m["ratio_min"] == pytest.approx(0.9, rel=1e-6)
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.0 + 1.05 + 0.9) / 4, rel=1e-6)
    kl = sum(r - 1 - math.log(r) for r in (1.1, 1.0, 1.05, 0.9)) / 4
    assert m["approx_kl"] == pytest.approx(kl, rel=1e-4)
    # gradients: finite everywhere, exactly zero on masked tokens
    loss_seq.backward()
    g = logp.grad
    assert torch.isfinite(g).all()
    assert (g[mask == 0] == 0).all()
    # seq_mean_token_mean: d/dlogp of -A*ratio / (n_tokens_in_seq * n_seqs)
    assert g[0, 0].item() == pytest.approx(-1.1 / (3 * 2), rel=1e-5)
    assert g[1, 0].item() == pytest.approx(0.9 / (1 * 2), rel=1e-5)


def test_nan_and_inf_padding_do_not_poison_gradients():
    # padding often holds NaN / -inf log-probs; only the first token is real (ratio 0.5)
    logp = torch.tensor([[math.log(0.5), -math.inf, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, math.nan]])
    loss, m = ppo_clip(logp, old, torch.tensor([1.0]), torch.tensor([[1.0, 0.0, 0.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0, 0.0]]))
    assert m["ratio_max"] == pytest.approx(0.5) and m["ratio_min"] == pytest.approx(0.5)
    assert all(math.isfinite(v) for v in m.values())


def test_clipped_tokens_have_zero_gradient_in_batch():
    old = torch.zeros(1, 4)
    log_r = torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5), math.log(1.0)]])
    logp = (old + log_r).requires_grad_(True)
    loss, m = ppo_clip(logp, old, torch.tensor([2.0]), torch.ones(1, 4), loss_agg="token_mean")
    loss.backward()
    # token 0 (ratio 1.5, A>0) clipped; others unclipped: grad = -A * ratio / 4
    expected = torch.tensor([[0.0, -2 * 1.1 / 4, -2 * 0.5 / 4, -2 * 1.0 / 4]])
    torch.testing.assert_close(logp.grad, expected)
    assert m["clip_frac"] == pytest.approx(0.25)
    assert loss.item() == pytest.approx(-2 * (1.2 + 1.1 + 0.5 + 1.0) / 4, rel=1e-6)


def test_is_weights_scale_loss_and_are_detached():
    old = torch.zeros(1, 2)
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = ppo_clip(logp, old, torch.tensor([1.0]), torch.ones(1, 2), is_weights=w)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    assert w.grad is None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -1.0]]))


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_all_zero_mask_gives_zero_not_nan(agg):
    logp = torch.full((2, 3), 50.0, requires_grad=True)
    old = torch.zeros(2, 3)
    loss, m = ppo_clip(logp, old, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), loss_agg=agg)
    assert loss.item() == 0.0
    loss.backward()
    assert (logp.grad == 0).all()
    assert all(math.isfinite(v) for v in m.values())


def test_aggregate_and_masked_reductions():
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_sum(x, mask).item() == 7.0
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.0]))
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(7.0 / 3)
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4.0) / 2)
    with pytest.raises(ValueError):
        aggregate(x, mask, "seq_sum")


def test_kl_k3():
    # d = ref - logp = -1: exp(-1) - (-1) - 1 = 0.367879
    v = kl_k3(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]))
    assert v.item() == pytest.approx(0.36787944, rel=1e-6)
    # d = +1: e - 2 = 0.718282
    assert kl_k3(torch.tensor([[-2.0]]), torch.tensor([[-1.0]])).item() == pytest.approx(
        0.71828183, rel=1e-6
    )
    a = torch.randn(4, 5)
    assert (kl_k3(a, a) == 0).all()
    g = torch.Generator().manual_seed(0)
    b = torch.randn(64, 32, generator=g) * 3
    c = torch.randn(64, 32, generator=g) * 3
    assert (kl_k3(b, c) >= 0).all()
    # padding garbage cannot overflow
    assert torch.isfinite(kl_k3(torch.tensor([[-500.0]]), torch.tensor([[0.0]]))).all()


def test_entropy_uniform_and_banned_tokens():
    v = 7
    ent = entropy_from_logits(torch.zeros(2, 3, v))
    assert ent.shape == (2, 3)
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(v)))
    # one-hot (very peaked) -> ~0; a -inf logit is finite and ignored: uniform over the rest
    assert entropy_from_logits(torch.tensor([[[100.0, 0.0, 0.0]]])).item() == pytest.approx(
        0.0, abs=1e-6
    )
    logits = torch.tensor([[[0.0, 0.0, -math.inf, 0.0]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent.item() == pytest.approx(math.log(3), rel=1e-6)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_token_logprobs_matches_manual_log_softmax_with_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 11, generator=g)
    targets = torch.randint(0, 11, (2, 4), generator=g)
    got = token_logprobs(logits, targets, temperature=0.5)
    z = logits / 0.5
    manual = z - z.exp().sum(-1, keepdim=True).log()
    expected = manual.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, expected)
    # hand check one element: logits [0, ln 3] at T=1 -> log(3/4) for target 1
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_logprobs(two, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32
    with pytest.raises(ValueError):
        token_logprobs(logits, targets, temperature=0.0)


def test_compute_policy_loss_combines_terms():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]])  # token 1 is masked out
    ref = torch.tensor([[-2.0, 0.0]])
    ent = torch.tensor([[2.0, 100.0]])
    mask = torch.tensor([[1.0, 0.0]])
    total, m = compute_policy_loss(
        logp, old, torch.tensor([1.0]), mask,
        ref_logprobs=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.05,
    )  # fmt: skip
    # pg = -1 * ratio 1 = -1 ; kl = 0.367879 ; entropy = 2 -> -1 + 0.0367879 - 0.1
    assert total.item() == pytest.approx(-1.0632121, rel=1e-6)
    assert m["train/pg_loss"] == pytest.approx(-1.0)
    assert m["train/kl"] == pytest.approx(0.36787944, rel=1e-6)
    assert m["train/entropy"] == pytest.approx(2.0)
    assert m["train/loss"] == pytest.approx(total.item())
    for key in ("train/clip_frac", "train/ratio_mean", "train/ratio_max", "train/approx_kl"):
        assert key in m
    total.backward()
    # d/dlogp: pg -1 ; kl 0.1 * d(exp(ref-l) - (ref-l) - 1)/dl = 0.1 * (1 - e^-1)
    assert logp.grad[0, 0].item() == pytest.approx(-1 + 0.1 * (1 - math.exp(-1)), rel=1e-5)
    assert logp.grad[0, 1].item() == 0.0
    # no ref / no entropy: only the pg term and no kl / entropy keys; kl_coef 0 logs but not adds
    total2, m2 = compute_policy_loss(logp, old, torch.tensor([1.0]), mask)
    assert total2.item() == pytest.approx(-1.0) and "train/kl" not in m2
    total3, m3 = compute_policy_loss(logp, old, torch.tensor([1.0]), mask, ref_logprobs=ref)
    assert total3.item() == pytest.approx(-1.0) and "train/kl" in m3


def test_loss_registry():
    assert get_policy_loss("ppo_clip") is ppo_clip and "ppo_clip" in POLICY_LOSSES
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("grpo_loss")


def test_dual_clip_set_from_the_algo_config_reaches_the_loss():
    from rollart.config import ConfigError, load_config
    from rollart.train.trainer import Trainer

    cfg = load_config("configs/default.yaml", ["algo.dual_clip=3.0", "algo.clip_high=0.28"])
    trainer = Trainer(torch.nn.Linear(1, 1), cfg.algo, cfg.train)
    assert trainer.loss_params == {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    # Two sequences of one token each, seq_mean_token_mean:
    #   A = -1, ratio 5:   standard max(5, 1.2) = 5, dual clip caps it at -A * 3 = 3 (no grad)
    #   A = +1, ratio 1.1: inside [0.8, 1.28] -> -1.1
    # loss = (3 - 1.1) / 2 = 0.95; without the dual clip (5 - 1.1) / 2 = 1.95.
    old = torch.tensor([[-1.0], [-1.0]])
    logp = (old + torch.tensor([[math.log(5.0)], [math.log(1.1)]])).requires_grad_(True)
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 1)
    total, m = compute_policy_loss(logp, old, adv, mask, loss_params=trainer.loss_params)
    assert total.item() == pytest.approx(0.95, rel=1e-6)
    assert m["train/dual_clip_frac"] == 0.5 and m["train/clip_frac"] == 0.0
    total.backward()
    assert logp.grad[0, 0].item() == 0.0  # capped: constant in logp
    assert logp.grad[1, 0].item() == pytest.approx(-1.1 / 2, rel=1e-5)  # -A * ratio / 2 seqs
    plain = Trainer(torch.nn.Linear(1, 1), load_config("configs/default.yaml").algo, cfg.train)
    assert plain.loss_params["dual_clip"] is None
    total, m = compute_policy_loss(logp, old, adv, mask, loss_params=plain.loss_params)
    assert total.item() == pytest.approx(1.95, rel=1e-6) and m["train/dual_clip_frac"] == 0.0
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config("configs/default.yaml", ["algo.dual_clip=1.0"])


def test_each_loss_gets_only_the_parameters_it_declares():
    assert loss_hyperparams("ppo_clip") == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    name = "test_scaled_pg"
    try:
        @register_loss(name)
        def scaled_pg(logprobs, old_logprobs, advantages, mask, *, loss_agg, is_weights=None,
                      scale: float = 2.0):
            return aggregate(-advantages.unsqueeze(-1) * logprobs * scale, mask, loss_agg), {}

        # the algo config's PPO fields are not forced on it; only what it declares is picked
        assert select_loss_params(name, {"clip_low": 0.1, "dual_clip": 3.0, "scale": 0.5}) \
            == {"scale": 0.5}
        logp, mask = torch.tensor([[-2.0]]), torch.ones(1, 1)
        total, _ = compute_policy_loss(logp, logp, torch.tensor([1.0]), mask, loss=name)
        assert total.item() == pytest.approx(4.0)  # -1 * -2 * default scale 2
        total, _ = compute_policy_loss(logp, logp, torch.tensor([1.0]), mask, loss=name,
                                       loss_params={"scale": 0.5})
        assert total.item() == pytest.approx(1.0)
        with pytest.raises(ValueError, match=r"has no parameters \['clip_low'\]"):
            compute_policy_loss(logp, logp, torch.tensor([1.0]), mask, loss=name,
                                loss_params={"clip_low": 0.2})
        with pytest.raises(ValueError, match="already registered"):
            register_loss(name)(scaled_pg)
    finally:
        POLICY_LOSSES.pop(name, None)
    with pytest.raises(TypeError, match="keyword-only"):
        register_loss("test_no_agg")(lambda logprobs, old, adv, mask: (logprobs.sum(), {}))
    assert "test_no_agg" not in POLICY_LOSSES
