"""Behaviour-policy corrections for off-policy (stale or engine-mismatched) tokens.

The PPO ratio in rollart is always taken against the *proximal* policy: the trainer's weights at
the start of the update, recomputed (decoupled PPO, AReaL). What differs between modes is how
the gap between that proximal policy and the behaviour policy `mu` (the engine's per-token
log-probs, possibly several versions old) is corrected:

- "none":     no correction.
- "tis":      truncated importance sampling per token, w = min(exp(prox - mu), cap).
- "tis_seq":  one weight per sequence, w = min(exp(sum_t (prox - mu)), cap), broadcast.
- "icepop":   mask tokens whose exp(prox - mu) leaves [low, high] (weight 0), others weight 1.

Weights are detached: they scale each token's loss, never its gradient path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollart.algo.losses import masked_mean

OFF_POLICY_MODES = ("none", "tis", "tis_seq", "icepop")
_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: keeps weights finite before truncation


def behaviour_weights(
    prox_logprobs: Tensor,  # [B, T] proximal policy log-probs of the sampled tokens
    behaviour_logprobs: Tensor,  # [B, T] engine log-probs (mu)
    mask: Tensor,  # [B, T] 1.0 on model tokens
    mode: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor | None, dict[str, float]]:
    """-> (weights [B, T] detached, or None for "none"; metrics under `train/is_*`)."""
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"off-policy mode must be one of {OFF_POLICY_MODES}, got {mode!r}")
    with torch.no_grad():
        log_ratio = ((prox_logprobs - behaviour_logprobs) * mask).clamp(-_LOG_CLAMP, _LOG_CLAMP)
        ratio = log_ratio.exp()  # [B, T]
        metrics = _ratio_metrics(ratio, mask)
        if mode == "none":
            return None, metrics
        if mode == "icepop":
            keep = ((ratio >= low) & (ratio <= high)).float()
            metrics["train/is_clipped_frac"] = masked_mean(1.0 - keep, mask).item()
            return keep * mask, metrics
        if mode == "tis_seq":
            seq = log_ratio.sum(dim=1, keepdim=True).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()  # [B, 1]
            ratio = seq.expand_as(mask)
        weights = ratio.clamp(max=cap)
        metrics["train/is_clipped_frac"] = masked_mean((ratio > cap).float(), mask).item()
        metrics["train/is_weight_mean"] = masked_mean(weights, mask).item()
        return weights * mask, metrics


def _ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, float]:
    on = mask > 0
    if not bool(on.any()):
        return {"train/is_ratio_mean": 1.0, "train/is_ratio_max": 1.0, "train/is_clipped_frac": 0.0}
    return {
        "train/is_ratio_mean": masked_mean(ratio, mask).item(),
        "train/is_ratio_max": float(ratio[on].max()),
        "train/is_clipped_frac": 0.0,
    }


def staleness_metrics(token_versions: list[list[int]], trainer_version: int) -> dict[str, float]:
    """Per-token staleness = trainer version - version that generated the token (model tokens)."""
    lags = [trainer_version - v for seq in token_versions for v in seq if v >= 0]
    if not lags:
        return {"train/staleness_mean": 0.0, "train/staleness_max": 0.0}
    return {"train/staleness_mean": sum(lags) / len(lags), "train/staleness_max": float(max(lags))}

