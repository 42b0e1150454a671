"""Pure tensor RL algorithms: advantage estimators, policy losses, KL/entropy, aggregation.

Two name registries, selected from config (`AlgoConfig.advantage`, `AlgoConfig.loss`):
`ADVANTAGE_ESTIMATORS` ("grpo", "dr_grpo", "rloo") and `POLICY_LOSSES` ("ppo_clip").
Add one with `@register_advantage(name)` / `@register_loss(name)`.
"""

from rollart.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo,
    get_advantage_estimator,
    grpo,
    register_advantage,
    rloo,
    zero_variance_groups,
)
from rollart.algo.losses import (
    AGG_MODES,
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

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "aggregate",
    "compute_policy_loss",
    "dr_grpo",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "grpo",
    "kl_k3",
    "loss_hyperparams",
    "masked_mean",
    "masked_sum",
    "ppo_clip",
    "register_advantage",
    "register_loss",
    "rloo",
    "select_loss_params",
    "token_logprobs",
    "zero_variance_groups",
]
