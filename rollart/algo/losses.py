"""Token-level policy losses, KL and entropy terms, and masked aggregation.

Shapes used throughout (padded batches):
    logprobs      [B, T]  current policy log-prob of each target token (requires grad)
    old_logprobs  [B, T]  log-probs of the policy the ratio is taken against (no grad)
    advantages    [B]     one per sequence, broadcast over tokens ([B, T] also accepted)
    mask          [B, T]  1.0 on model-generated tokens, 0.0 elsewhere (prompt, env obs, padding)

Masked-out positions never influence a loss, a gradient or a metric, even when they hold
inf/NaN-producing values (e.g. a log-ratio of +100): they are replaced *before* any `exp`.

Every registered policy loss has the signature
    fn(logprobs, old_logprobs, advantages, mask, *, loss_agg, is_weights, **hyper)
        -> (loss: scalar Tensor, metrics: dict[str, float])
where `hyper` are the loss's own keyword-only parameters with their defaults (ppo_clip:
clip_low, clip_high, dual_clip). The registry records them (`loss_hyperparams`), so the caller
passes each loss only what it declares (`select_loss_params` picks them out of a config).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, LossFn] = {}
_LOSS_HYPERPARAMS: dict[str, dict[str, object]] = {}  # name -> {parameter: default}
_COMMON = ("loss_agg", "is_weights")  # passed to every loss by compute_policy_loss
AGG_MODES = ("seq_mean_token_mean", "token_mean")
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-20 before exp (as verl does) to avoid inf


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: add a policy loss to `POLICY_LOSSES` under `name`."""

    def deco(fn: LossFn) -> LossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        params = {n: p.default for n, p in inspect.signature(fn).parameters.items()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY}
        missing = [c for c in _COMMON if c not in params]
        if missing:  # fail at registration, not at the first update
            raise TypeError(f"policy loss {name!r} must take keyword-only {missing}")
        POLICY_LOSSES[name] = fn
        _LOSS_HYPERPARAMS[name] = {n: d for n, d in params.items() if n not in _COMMON}
        return fn

    return deco


def get_policy_loss(name: str) -> LossFn:
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def loss_hyperparams(name: str) -> dict[str, object]:
    """The hyper-parameters loss `name` declares -> their defaults (inspect.Parameter.empty
    for a required one)."""
    get_policy_loss(name)
    return dict(_LOSS_HYPERPARAMS[name])


def select_loss_params(name: str, values: Mapping[str, object]) -> dict[str, object]:
    """The hyper-parameters of loss `name` that `values` sets (e.g. `AlgoConfig.model_dump()`:
    a config field named like a loss parameter sets it); the others keep the loss's defaults."""
    return {k: values[k] for k in loss_hyperparams(name) if k in values}


# --------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask != 0. x, mask: same shape (e.g. [B, T]); masked values are dropped
    with `where`, so inf/NaN under the mask cannot leak in."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask != 0 (0, with grad, when there are none).
    x, mask: same shape; dim=None reduces everything."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def aggregate(loss_tok: Tensor, mask: Tensor, mode: str = "seq_mean_token_mean") -> Tensor:
    """Reduce a per-token loss to a scalar.

    loss_tok: [B, T]; mask: [B, T].
    "token_mean" (DAPO): sum over all masked tokens / number of masked tokens in the batch, so
        long sequences weigh more.
    "seq_mean_token_mean" (GRPO paper): token mean within each sequence, then the mean over
        sequences that have at least one masked token (empty sequences are excluded).
    Returns 0 (still attached to the graph) when the mask is all zero.
    Note: both are means over *this* batch; with gradient accumulation over micro-batches the
    caller weights each micro-batch (by its tokens or sequences) to get the global mean.
    """
    if mode == "token_mean":
        return masked_mean(loss_tok, mask)
    if mode == "seq_mean_token_mean":
        seq_mean = masked_mean(loss_tok, mask, dim=-1)  # [B]
        has_tokens = mask.bool().any(dim=-1)  # [B]
        return masked_mean(seq_mean, has_tokens)
    raise ValueError(f"unknown loss_agg {mode!r}; expected one of {AGG_MODES}")


# --------------------------------------------------------------------------------------------
# Per-token quantities from logits
# --------------------------------------------------------------------------------------------


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at `targets`.

    logits: [B, T, V]; targets: [B, T] long -> [B, T].
    Position t of `logits` must already be the prediction for `targets[:, t]`: the caller does the
    causal shift (`logits[:, :-1]` vs `input_ids[:, 1:]`). Use the sampling temperature so the
    log-probs match the behaviour policy. Half-precision logits are upcast to float32. Computed
    as gather - logsumexp, so no second [B, T, V] log-softmax tensor is kept.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position. logits: [B, T, V] -> [B, T].

    Stable via log_softmax; logits of -inf (banned tokens) contribute 0 instead of NaN.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)  # [B, T, V]
    logp = logp.clamp_min(torch.finfo(logp.dtype).min)  # -inf -> finite; p = 0 there anyway
    return -(logp.exp() * logp).sum(-1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || ref) per token (Schulman): exp(d) - d - 1 with d = ref - logp.

    logprobs: [B, T] (current policy, sampled tokens); ref_logprobs: [B, T] -> [B, T], >= 0,
    exactly 0 where the two agree. d is clamped to +-20 so padding garbage cannot overflow.
    """
    d = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


# --------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------


@register_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,  # [B, T] requires grad
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B] (or [B, T])
    mask: Tensor,  # [B, T]
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "seq_mean_token_mean",
    is_weights: Tensor | None = None,  # [B, T] off-policy weights, used detached
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, per token, with optional asymmetric (DAPO) and dual clipping.

    ratio = exp(logprobs - old_logprobs)
    loss_tok = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    dual clip (Ye et al. 2020, c = dual_clip > 1): for A < 0, loss_tok = min(loss_tok, -A * c)
    loss_tok *= is_weights (detached), then `aggregate(loss_tok, mask, loss_agg)`.

    Metrics (over masked tokens; all 0 when the mask is empty):
      clip_frac       fraction where the standard clip is active (clipped branch is larger)
      dual_clip_frac  fraction where the dual clip is active (0 without dual_clip)
      ratio_mean, ratio_max, ratio_min
      approx_kl       k3 estimate of KL(old || new): ratio - 1 - log(ratio)
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (3.0 is usual), got {dual_clip}")
    valid = mask.bool()  # [B, T]
    adv = advantages.detach()
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    log_ratio = logprobs - old_logprobs.detach()
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))  # before exp
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [B, T]

    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    clipped = loss_clipped > loss_unclipped
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss_tok > cap)
        loss_tok = torch.where(dual_active, cap.expand_as(loss_tok), loss_tok)
    if is_weights is not None:
        loss_tok = loss_tok * is_weights.detach()

    loss = aggregate(loss_tok, mask, loss_agg)
    with torch.no_grad():
        r = ratio.detach()
        any_tok = bool(valid.any())
        metrics = {
            "clip_frac": masked_mean(clipped.float(), valid).item(),
            "dual_clip_frac": masked_mean(dual_active.float(), valid).item(),
            "ratio_mean": masked_mean(r, valid).item(),
            "ratio_max": r[valid].max().item() if any_tok else 0.0,
            "ratio_min": r[valid].min().item() if any_tok else 0.0,
            "approx_kl": masked_mean(r - 1.0 - log_ratio.detach(), valid).item(),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Full objective
# --------------------------------------------------------------------------------------------


def compute_policy_loss(
    logprobs: Tensor,  # [B, T] requires grad
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B] (or [B, T])
    mask: Tensor,  # [B, T]
    *,
    loss: str = "ppo_clip",
    loss_agg: str = "seq_mean_token_mean",
    loss_params: Mapping[str, object] | None = None,  # the loss's own hyper-parameters
    ref_logprobs: Tensor | None = None,  # [B, T] reference policy, for the KL term
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,  # [B, T] per-token entropy (with grad), see entropy_from_logits
    entropy_coef: float = 0.0,
    is_weights: Tensor | None = None,  # [B, T] detached off-policy weights
) -> tuple[Tensor, dict[str, float]]:
    """total = pg_loss + kl_coef * agg(kl_k3(logprobs, ref)) - entropy_coef * agg(entropy).

    `loss_params` go to the loss `loss` and may name only parameters it declares (ValueError
    otherwise: a typo must not silently train with a default); what they leave out keeps the
    loss's default. All terms use the same `loss_agg` over the same mask. The KL term is added
    when `ref_logprobs` is given and kl_coef > 0; the entropy bonus when `entropy` is given (both
    are logged whenever their inputs are given, even with a zero coefficient).
    Metrics: train/loss, train/pg_loss, train/clip_frac, train/dual_clip_frac, train/ratio_mean,
    train/ratio_max, train/ratio_min, train/approx_kl, and when available train/kl,
    train/entropy.
    """
    pg_fn = get_policy_loss(loss)
    params = dict(loss_params or {})
    unknown = sorted(set(params) - set(_LOSS_HYPERPARAMS[loss]))
    if unknown:
        raise ValueError(f"policy loss {loss!r} has no parameters {unknown}; it takes "
                         f"{sorted(_LOSS_HYPERPARAMS[loss])}")
    pg_loss, pg_metrics = pg_fn(logprobs, old_logprobs, advantages, mask, loss_agg=loss_agg,
                                is_weights=is_weights, **params)
    total = pg_loss
    metrics = {"train/pg_loss": pg_loss.item()}
    metrics.update({f"train/{k}": v for k, v in pg_metrics.items()})
    if ref_logprobs is not None:
        kl = aggregate(kl_k3(logprobs, ref_logprobs.detach()), mask, loss_agg)
        metrics["train/kl"] = kl.item()
        if kl_coef > 0:
            total = total + kl_coef * kl
    if entropy is not None:
        ent = aggregate(entropy, mask, loss_agg)
        metrics["train/entropy"] = ent.item()
        if entropy_coef > 0:
            total = total - entropy_coef * ent
    metrics["train/loss"] = total.item()
    return total, metrics
