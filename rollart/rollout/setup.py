"""Building the run's rollout service from its spec: chat format, per-task sampling, rewards."""

from __future__ import annotations

from typing import Any

from rollart.config import RunConfig
from rollart.handles import set_call_timeout
from rollart.models.run_model import chat_format
from rollart.rewards.client import make_reward_client
from rollart.rollout.env_manager import constrained_params
from rollart.rollout.service import RolloutService
from rollart.run import RunSpec
from rollart.types import SamplingParams


def sampling_params(cfg: RunConfig, greedy: bool = False) -> SamplingParams:
    """Training sampling from `engine.*`; greedy (T = 0, no top-p) for evaluation."""
    e = cfg.engine
    return SamplingParams(max_new_tokens=e.max_new_tokens, temperature=0.0 if greedy else
                          e.temperature, top_p=1.0 if greedy else e.top_p, stop=list(e.stop))


def build_rollout_service(run: RunSpec, engines: list[Any], hosts: list[Any],
                          version: int = 0, shard: tuple[int, int] = (0, 1)) -> RolloutService:
    """The run's rollout service, or shard k of n of it (`shard` (k, n)); not started."""
    set_call_timeout(run.cfg.cluster.call_timeout_s)  # its calls to engines and env hosts
    chat = chat_format(run)
    return RolloutService(run.cfg, chat, engines, hosts, make_reward_client(run.cfg.reward),
                          constrained_params(sampling_params(run.cfg), chat, run.cfg.tasks,
                                             run.cfg.engine.answer_grammar),
                          version, run.max_context, shard=shard)
