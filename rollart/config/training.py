"""Config of what one iteration does: `tasks:`, `rollout:`, `algo:`, `train:`, `eval:`,
`logging:`.

Part of the `rollart.config` package; import from `rollart.config`, which re-exports it.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, model_validator

from rollart.config.base import _Strict
from rollart.config.sections import FaultConfig, LatencyConfig


class TaskConfig(_Strict):
    """One environment kind and its share of each batch."""

    name: str = "frozenlake"
    """Task name (metrics per task are logged under it)."""
    env_id: str = "FrozenLake-v1"
    """Registered environment id: a gymnasium toy-text env (e.g. FrozenLake-v1) or one of rollart's
    (`arith`, `guess`, `calculator`)."""
    env_kwargs: dict[str, Any] = {"map_name": "4x4", "is_slippery": False}
    """Keyword arguments of the environment's constructor."""
    share: float = Field(1.0, gt=0.0)
    """relative share of groups per batch."""
    max_turns: int = Field(8, gt=0)
    """Turns per episode at most."""
    format_penalty: float = -0.1
    """per turn without the strict format (half with lenient action)"""
    parser: Literal["strict", "lenient"] = "lenient"
    """lenient: first action word if no tags."""
    format_credit: Literal["graded", "action"] = "graded"
    """`graded`: partial credit per format piece present; `action`: penalise only turns without any
    parsable action (no reward noise from formatting once actions flow)."""
    seeds: Literal["fixed", "random"] = "random"
    """reset seeds: one fixed seed or fresh per group."""
    constrained: bool = False
    """Constrained sampling: the policy may only emit the answer format: one of the complete
    `<answer>{action}</answer>` completions (HF engine: token by token along their prefix tree) or,
    with vLLM, any of their tokens. For tiny models trained from scratch; log-probs stay exact (the
    trainer applies the same restriction per position)."""
    eval_seed_offset: int = 1_000_000
    """evaluation seeds are disjoint from training seeds."""
    max_new_tokens: int | None = Field(None, gt=0)
    """per-turn cap; None: engine.max_new_tokens."""
    latency: LatencyConfig | None = None
    """injected step latency (benchmarks, slow-tool stand-in)"""
    faults: FaultConfig | None = None
    """injected step errors / a hang (resilience tests)"""


class RolloutConfig(_Strict):
    """Rollout service. Each update consumes `num_groups` complete groups of `group_size`.

    An episode begun under policy version v may feed update u only if u - v <= max_staleness;
    0 is the synchronous baseline (same code). Groups launch group_size + redundancy episodes and
    keep the first group_size finishers. A failed or timed-out episode is re-issued up to
    max_retries times per group member."""

    num_groups: int = Field(4, gt=0)
    """Groups per update (each a set of episodes from the same seed)."""
    group_size: int = Field(16, gt=0)
    """Episodes per group (at least 2: advantages are computed within a group)."""
    max_staleness: int = Field(0, ge=0, le=8)
    """Bounded staleness alpha: an episode begun under policy version v may feed update u only if u
    - v <= alpha; 0 is synchronous."""
    redundancy: int = Field(0, ge=0)
    """Extra episodes launched per group; the first group_size to finish are kept and the rest
    cancelled."""
    max_retries: int = Field(2, ge=0)
    """Re-issues of a failed or timed-out episode per group member before the group is dropped."""
    resample_uniform: int = Field(0, ge=0, le=16)
    """Dynamic sampling: a complete group whose episodes all scored alike (zero GRPO advantage, so
    no gradient) is set aside and a fresh group (new seed) started in its batch slot, up to this
    many times per slot; the last try is kept whatever it scored. 0 keeps every group. Costs
    rollout time; set-aside episodes are counted (`rollout/groups_resampled`) and never trained."""
    max_consecutive_failures: int = Field(64, ge=0)
    """This many failed episodes in a row (no episode finishing in between) end the run with the
    last errors: a broken env or engine fails fast instead of retrying forever. 0 disables."""
    env_timeout_s: float = Field(60.0, gt=0.0)
    """one env reset/step; past it the episode fails."""
    env_host_threads: int = Field(64, gt=0)
    """concurrent env calls per env host (CPU worker)"""
    engine_wait_timeout_s: float = Field(300.0, gt=0.0)
    """A lost engine replica's turns go to the others; with none left, episodes wait this long for
    one to come back (a replacement on a (re)joining worker of its class), then the run fails naming
    the cause."""
    batching: Literal["lockstep", "continuous"] = "lockstep"
    """`lockstep`: an engine's batch waits for a turn of every live episode on it (the classic
    synchronous rollout; deterministic, so resume is exact). `continuous`: whatever turns are ready
    go (turn-level continuous batching; episodes never wait for each other)."""
    batch_wait_s: float = Field(0.002, ge=0.0)
    """continuous: wait this long to fill a batch."""
    runner: Literal["threads", "asyncio"] = "threads"
    """`threads`: one Python thread per live episode (and per engine batcher); `asyncio`: every
    episode a task on one event loop thread (rollart/rollout/aio_runner.py), thread count
    independent of the number of episodes. Same scheduler, ledger and metrics."""
    event_loop: Literal["uvloop", "select"] = "select"
    """asyncio runner only: its event loop. `select`: the standard library's selector loop on
    select(2), microsecond timers. `uvloop` (libuv, in C) spends less CPU per turn on a lightly
    loaded loop, but its timers count whole milliseconds (a 2 ms `batch_wait_s` waits 2-3 ms) and
    its turn-overhead p99 was higher in every calm run of benchmarks/rollout_scale.py (which
    compares them in one run; see the docs)."""
    idle_poll_us: float = Field(0.0, ge=0.0, le=10_000.0)
    """asyncio runner on the select loop only: microseconds the loop keeps polling for ready events
    before it sleeps in select(2). A wake-up from sleep costs ~20 us of CPU on these VMs (a probe)
    and runs the next callbacks on cold caches; polling spends the idle time instead, so the core
    shows busy (0.73-0.94 of it at 4,096-8,192 episodes with 200). benchmarks/rollout_scale.py
    measured 200 against 0 (headline.idle_poll): use it where a shard has a core of its own, never
    where the worker's other threads need that core. 0: sleep at once."""
    start_rate: float = Field(2000.0, gt=0.0)
    """asyncio runner only: new episodes per second a shard starts at most (in slices 1 ms apart: a
    batch's worth of episodes started at once holds up every turn in flight for tens of
    milliseconds). 2,000/s keeps ~12,000 turns/s of six-turn episodes going; raise it for shorter
    episodes on a shard with CPU to spare."""
    gc_every_s: float | None = Field(300.0, gt=0.0)
    """asyncio runner only: seconds between the process's garbage collections while the loop runs;
    automatic collection is off (after a gc.freeze() of everything allocated before). At thousands
    of live episodes the young generation holds the in-flight coroutines, futures and turns of every
    episode, so even generation-0 collections stalled the loop (benchmarks/rollout_scale.py's
    overhead p99 at 4,096 episodes: see the docs); the episode path makes no reference cycles
    (tests/unit/test_rollout_aio_runner.py), so a rare collection only guards against leaks from
    error paths. None leaves the collector alone."""
    switch_interval_s: float | None = Field(0.0005, gt=0.0)
    """asyncio runner only: the process's GIL switch interval at most this (Python's default is 5
    ms: a thread of the trainer's side computing a batch's metrics holds the loop up that long per
    switch); None leaves it alone."""
    shards: int = Field(1, ge=1)
    """Rollout service shards (rollart/rollout/shards.py): each owns a partition of every batch's
    groups and routes its turns to every engine replica; on a Dask cluster shard k runs on env-class
    worker k mod (env workers), so shards pay only on separate workers (processes)."""

    @model_validator(mode="after")
    def _group(self) -> RolloutConfig:
        if self.group_size < 2:
            raise ValueError(
                "group_size must be >= 2: group-normalised advantages are all zero for groups of 1"
            )
        if self.runner == "asyncio" and self.event_loop == "uvloop" \
                and importlib.util.find_spec("uvloop") is None:
            raise ValueError(
                "rollout.event_loop=uvloop but uvloop is not installed: `pip install uvloop` "
                "(a dependency of rollart on Linux and macOS), or set rollout.event_loop=select")
        if self.idle_poll_us and self.event_loop != "select":
            raise ValueError(
                f"rollout.idle_poll_us={self.idle_poll_us} needs rollout.event_loop=select "
                "(uvloop waits in libuv's epoll): set event_loop=select or idle_poll_us=0")
        if self.shards > self.num_groups:
            raise ValueError(
                f"rollout.shards={self.shards} but rollout.num_groups={self.num_groups}: every "
                "shard owns at least one group of each batch; lower shards or raise num_groups")
        return self


class AlgoConfig(_Strict):
    advantage: str = "grpo"
    """registry key in rollart.algo."""
    loss: str = "ppo_clip"
    """registry key in rollart.algo."""
    clip_low: float = Field(0.2, ge=0.0)
    """PPO clip below: the ratio is clipped at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0.0)
    """PPO clip above: the ratio is clipped at 1 + clip_high (asymmetric clipping when it differs
    from clip_low)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual clip (Ye et al. 2020): for A < 0 the per-token loss is capped at -A * dual_clip (3.0 is
    usual); None disables. The loss takes the fields named like its parameters."""
    loss_agg: Literal["seq_mean_token_mean", "token_mean"] = "seq_mean_token_mean"
    """How token losses are averaged: per sequence then over sequences, or over all tokens
    (DAPO)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """k3 KL to the initial policy; 0 disables the reference."""
    entropy_coef: float = Field(0.05, ge=0.0)
    """Weight of the entropy bonus."""
    std_eps: float = Field(1e-6, gt=0.0)
    """Added to the group's reward standard deviation when advantages are normalised by it."""
    normalize_std: bool = True
    """False gives Dr.GRPO."""
    off_policy: Literal["none", "tis", "tis_seq", "icepop"] = "tis"
    """Behaviour correction against the engine's log-probs (see rollart.algo.offpolicy); the PPO
    ratio is always against the policy at update start (decoupled PPO)."""
    is_cap: float = Field(2.0, gt=0.0)
    """truncation C of the importance weight."""
    icepop_low: float = Field(0.5, gt=0.0)
    """off_policy `icepop`: tokens whose trainer/engine probability ratio is below this are
    masked."""
    icepop_high: float = Field(2.0, gt=0.0)
    """off_policy `icepop`: tokens whose trainer/engine probability ratio is above this are
    masked."""
    constrained_logprobs: Literal["restricted", "vocab"] = "restricted"
    """Turns sampled under a restriction (a task's `constrained: true`): "restricted" takes each
    token's log-probability under the tokens it was sampled from, the engine's own distribution;
    "vocab" over the whole vocabulary, as TRL's GRPOTrainer does (the restriction is then part of
    the environment, and the loss also moves the probability outside it). "vocab" needs
    off_policy none: the engine's log-probs are the restricted ones."""

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if self.constrained_logprobs == "vocab" and self.off_policy != "none":
            raise ValueError("algo.constrained_logprobs: vocab compares the trainer's whole-"
                             "vocabulary log-probs, but off_policy corrections compare them with "
                             "the engine's restricted ones; set algo.off_policy: none or "
                             "algo.constrained_logprobs: restricted")
        return self


class TrainConfig(_Strict):
    lr: float = Field(1e-3, gt=0.0)
    """AdamW learning rate (constant)."""
    epochs: int = Field(2, gt=0)
    """PPO epochs over each batch."""
    micro_batch_size: int = Field(64, gt=0)
    """Sequences per forward/backward pass (gradients accumulate over a batch)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient norm clip."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    threads: int = Field(2, gt=0)
    """torch intra-op threads on the trainer worker while updating."""
    shared_prefix: bool = True
    """A GRPO group's common prompt goes through the model once per micro-batch, its K/V shared by
    the members (rollart/train/shared_prefix.py); same loss and gradient, fewer FLOPs. One rank
    only: a sharded trainer (world_size > 1) runs the plain forward."""
    max_kl: float = Field(0.0, ge=0.0)
    """Trust-region guard: after the epochs, the mean per-token KL(policy at update start || new) on
    the batch's model tokens (k3 estimate); above max_kl the step is scaled back along the line from
    the start (KL ~ quadratic in the step). 0 disables. Adam can take a step of KL ~1 from a small
    gradient; with stale batches that collapsed runs (docs: concepts/rollout.md, staleness)."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks: the model, gradients and optimizer state FSDP2-sharded over this many
    trainer-class workers (one rank each, one torch.distributed group; gloo on CPU, nccl on CUDA).
    1: one trainer process, unsharded (the default)."""
    dist_timeout_s: float = Field(300.0, gt=0.0)
    """How long a rank waits in a collective for the others (a lost rank fails the rest after this,
    and the run restarts its services from the last checkpoint)."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """CUDA only: bf16 parameters in compute, fp32 gradient reduction (FSDP2 MixedPrecisionPolicy).
    """


class EvalConfig(_Strict):
    episodes: int = Field(32, ge=0)
    """Greedy episodes on held-out seeds per evaluation; 0 turns evaluation off."""
    every: int = Field(10, ge=0)
    """0: only at the end."""
    before_training: bool = False
    """Also evaluate the initial policy before the first update (a fresh run, not a resume): a
    metrics row with iteration -1 and version 0, the baseline the curve starts from."""
    stop_at: float | None = Field(None, gt=0.0, le=1.0)
    """Early stop: end the run (after a checkpoint) once `stop_after` greedy evaluations in a row
    reach `stop_at`. None: run all `iterations`. Acts only on periodic evaluations (episodes > 0 and
    every > 0), so `--set eval.every=0` also turns it off."""
    stop_after: int = Field(2, ge=1)
    """How many evaluations in a row must reach `stop_at` for the run to stop early."""


class LoggingConfig(_Strict):
    """Where metrics go besides the run's `metrics.jsonl` (always written)."""

    tensorboard: bool = False
    """scalars per iteration, `tensorboard --logdir <dir>`."""
    tensorboard_dir: str = "artifacts/tensorboard"
    """local directory; one subdirectory per run."""

    @model_validator(mode="after")
    def _tensorboard_installed(self) -> LoggingConfig:
        import importlib.util

        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("logging.tensorboard needs the tensorboard package "
                             "(pip install 'rollart[tensorboard]', part of the dev venv)")
        return self


def rollout_defaults() -> dict[str, Any]:
    """The default of every `rollout.*` key: the one home of these defaults, which the rollout
    scheduler (`SchedulerConfig`) and the simulator (`SimConfig`) take theirs from."""
    return {name: f.default for name, f in RolloutConfig.model_fields.items()}
