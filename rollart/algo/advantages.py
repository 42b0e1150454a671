"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO).

Every estimator maps one scalar reward per sample to one advantage per sample, using the samples
that share a group id (same prompt / same env seed) as the baseline. They are pure tensor
functions with one shared signature so the trainer can pick one by name from config:

    fn = get_advantage_estimator(cfg.algo.advantage)
    adv = fn(rewards, group_ids, normalize_std=cfg.algo.normalize_std, std_eps=cfg.algo.std_eps)

Guarantee shared by all estimators: a group whose rewards are all equal (including a group of
one sample) gets exactly 0.0 advantage for every member - never NaN, never float noise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

AdvantageFn = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
GroupIds = Sequence[Hashable] | Tensor


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: add an estimator to `ADVANTAGE_ESTIMATORS` under `name`."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def get_advantage_estimator(name: str) -> AdvantageFn:
    if name not in ADVANTAGE_ESTIMATORS:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise KeyError(f"unknown advantage estimator {name!r}; known: {known}")
    return ADVANTAGE_ESTIMATORS[name]


# --------------------------------------------------------------------------------------------
# Grouping helpers
# --------------------------------------------------------------------------------------------


def _group_index(rewards: Tensor, group_ids: GroupIds) -> tuple[Tensor, list[Any]]:
    """Map arbitrary hashable ids to dense indices.

    rewards: [N]; group_ids: N hashables or a Tensor[N].
    Returns (index [N] long in [0, G), keys: the G original ids in first-seen / sorted order).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if len(group_ids) != n:
        raise ValueError(f"got {n} rewards but {len(group_ids)} group ids")
    if isinstance(group_ids, Tensor):
        uniq, index = torch.unique(group_ids.reshape(-1), return_inverse=True)
        return index.to(rewards.device), uniq.tolist()
    keys: dict[Hashable, int] = {}
    index_list = [keys.setdefault(g, len(keys)) for g in group_ids]
    index = torch.tensor(index_list, dtype=torch.long, device=rewards.device)
    return index, list(keys)


def _group_stats(r: Tensor, index: Tensor, num_groups: int) -> dict[str, Tensor]:
    """Per-group count, sum, mean, sample std and an all-equal flag. r: [N] float64."""
    zeros = torch.zeros(num_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, index, torch.ones_like(r))  # [G]
    total = zeros.index_add(0, index, r)  # [G]
    mean = total / count  # [G]; every group has >= 1 member
    sq_dev = zeros.index_add(0, index, (r - mean[index]) ** 2)  # [G]
    std = torch.sqrt(sq_dev / (count - 1).clamp_min(1))  # [G] sample (unbiased) std
    gmax = torch.full_like(zeros, -torch.inf).scatter_reduce(0, index, r, "amax")
    gmin = torch.full_like(zeros, torch.inf).scatter_reduce(0, index, r, "amin")
    return {"count": count, "sum": total, "mean": mean, "std": std, "constant": gmax == gmin}


def _prepare(rewards: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    rewards = torch.as_tensor(rewards)
    index, keys = _group_index(rewards, group_ids)
    r = rewards.detach().to(torch.float64)  # float64 for the group sums; cast back at the end
    if not torch.isfinite(r).all():
        bad = int((~torch.isfinite(r)).sum())
        raise ValueError(f"{bad} reward(s) are NaN or inf; fix the reward function")
    return r, index, _group_stats(r, index, len(keys))


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def zero_variance_groups(rewards: Tensor, group_ids: GroupIds) -> set[Hashable]:
    """Ids of the groups whose rewards are all equal (these carry no GRPO learning signal).

    rewards: [N]; group_ids: N hashables or Tensor[N] (tensor ids come back as Python scalars).
    """
    rewards = torch.as_tensor(rewards)
    index, keys = _group_index(rewards, group_ids)
    stats = _group_stats(rewards.detach().to(torch.float64), index, len(keys))
    return {keys[g] for g in stats["constant"].nonzero().flatten().tolist()}


# --------------------------------------------------------------------------------------------
# Estimators. Shared signature: (rewards [N], group_ids, *, normalize_std, std_eps) -> [N]
# --------------------------------------------------------------------------------------------


@register_advantage("grpo")
def grpo(
    rewards: Tensor,  # [N] one scalar reward per sample
    group_ids: GroupIds,  # N hashable ids (or Tensor[N]); equal id = same group
    *,
    normalize_std: bool = True,
    std_eps: float = 1e-6,
) -> Tensor:  # [N]
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps).

    std_g is the *sample* standard deviation (Bessel-corrected, divides by n-1), the same as
    `torch.std` used by TRL and verl. `normalize_std=False` gives Dr.GRPO (A_i = r_i - mean_g).
    All-equal groups and groups of one get exactly 0.
    """
    r, index, stats = _prepare(rewards, group_ids)
    adv = r - stats["mean"][index]
    if normalize_std:
        adv = adv / (stats["std"][index] + std_eps)
    adv = torch.where(stats["constant"][index], torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(torch.as_tensor(rewards)))


@register_advantage("dr_grpo")
def dr_grpo(
    rewards: Tensor,  # [N]
    group_ids: GroupIds,  # N ids
    *,
    normalize_std: bool = True,  # ignored: Dr.GRPO never divides by the std
    std_eps: float = 1e-6,  # ignored
) -> Tensor:  # [N]
    """Dr.GRPO (Liu et al. 2025): A_i = r_i - mean_g, whatever `normalize_std` says."""
    return grpo(rewards, group_ids, normalize_std=False, std_eps=std_eps)


@register_advantage("rloo")
def rloo(
    rewards: Tensor,  # [N]
    group_ids: GroupIds,  # N ids
    *,
    normalize_std: bool = True,  # ignored: RLOO has no std normalisation
    std_eps: float = 1e-6,  # ignored
) -> Tensor:  # [N]
    """RLOO: A_i = r_i - mean of the *other* members of i's group; groups of one get 0.

    Equivalent to n/(n-1) * (r_i - mean_g), so it is Dr.GRPO rescaled per group size.
    """
    r, index, stats = _prepare(rewards, group_ids)
    count = stats["count"][index]
    others_mean = (stats["sum"][index] - r) / (count - 1).clamp_min(1)
    adv = r - others_mean
    zero = stats["constant"][index] | (count < 2)
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(torch.as_tensor(rewards)))
