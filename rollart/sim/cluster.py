"""The full system's parameters, typed and validated, each default with where it comes from.

`SystemConfig` wraps a `SimConfig` (tasks, rollout settings, iterations, seed) and adds what the
plain simulator takes as constants: engine pools priced by the hardware catalog and the router's
cost model, environments that take time to start and may fail to, reward scoring capacity,
an update time from tokens and GPUs, a weight sync from model bytes and bandwidth.

Units: seconds, tokens, bytes; FLOP/s and bytes/s come from `rollart.routing.catalog`.
"Assumption" marks a default we chose without a measurement; override it with yours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from rollart.config import LatencyConfig
from rollart.routing.catalog import DEFAULT_CATALOG, HardwareClass
from rollart.routing.router import POLICIES, CostModel, Policy
from rollart.sim.rewards import RewardModel
from rollart.sim.workload import SimConfig, SimConfigError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SimConfigError(message)


@dataclass(frozen=True)
class ModelSpec:
    """The policy. Default: a Qwen3-30B-A3B-class MoE in bf16 (30.5B parameters, 3.3B active per
    token: the Qwen3 model card). `active_params` (None: dense, = params) sets the FLOPs per token
    (2 x active: prefill, decode compute, training); the weights read per decode step are all of
    them (at a decode batch of 64 rows nearly every expert is hit). kv_bytes_per_token: KV read
    per generated token on top of the weights' share (0: ignored, i.e. short contexts)."""

    params: float = 30.5e9
    bytes_per_param: float = 2.0
    active_params: float | None = 3.3e9
    kv_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        _check(self.params > 0 and self.bytes_per_param > 0 and self.kv_bytes_per_token >= 0,
               "model: params and bytes_per_param must be > 0, kv_bytes_per_token >= 0")
        _check(self.active_params is None or 0 < self.active_params <= self.params,
               "model: active_params must be in (0, params]")

    @property
    def active(self) -> float:
        return self.params if self.active_params is None else self.active_params

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def cost_model(self, decode_batch: int) -> CostModel:
        """The router's cost model (rollart.routing.CostModel; for a dense model the same as
        CostModel.for_model), batch-aware over `decode_batch` rows as the rollout service
        configures it (routing.decode_batch: the engines' batch)."""
        return CostModel(flops_per_token=2.0 * self.active,
                         bytes_per_token=self.weight_bytes / max(decode_batch, 1)
                         + self.kv_bytes_per_token, decode_batch=max(decode_batch, 1))


@dataclass(frozen=True)
class PoolModel:
    """Engine replicas of one hardware class. A replica spans `gpus_per_replica` GPUs (tensor
    parallel), so its FLOP/s and bandwidth are that many times the class's.

    continuous (default, as vLLM): up to `max_batch` turns in flight; a queued turn joins as soon
    as a row is free and returns when its own answer ends, after
        overhead_s + prefill_i * F / (FLOP/s * prefill_eff) + decode_i * step(rows)
    with step(rows) the roofline step below at the rows in flight when it joined (later joiners'
    prefill does not slow it down: an approximation).
    static (as the HF engine): a generate call serves up to `max_batch` queued turns, all
    returned at the call's end:
        call_s = overhead_s + sum_i prefill_i * F / (FLOP/s * prefill_eff) + decode part
    F = 2 x params per prompt token (prefill_i: the turn's new tokens on the replica holding the
    episode's prefix, new + context tokens elsewhere). Decode part:
      roofline  each decode step reads the weights once for all rows and computes 2 x params per
                row: sum over steps of max(W / (bw * decode_eff), rows(step) * F / (FLOP/s *
                prefill_eff)), rows(step) = rows still decoding (a call lasts as long as its
                longest answer, as static batching does)
      per_row   the router's own estimate: sum_i decode_i * W / max_batch / (bw * decode_eff)
                (what an engine that sleeps the cost model's time would take)
    Defaults: TP 4 (64 GB of bf16 weights plus KV on 80-96 GB parts); 64 rows per call
    (assumption; vLLM's max_num_seqs default is 256); prefill at 40 % of peak FLOP/s (assumption
    in the 30-50 % range inference engines report); decode at 60 % of peak bandwidth (Databricks'
    "LLM inference performance engineering" measured MBU ~60 % on H100)."""

    hw: str
    replicas: int
    gpus_per_replica: int = 4
    max_batch: int = 64
    overhead_s: float = 0.0
    prefill_eff: float = 0.4
    decode_eff: float = 0.6
    decode: Literal["roofline", "per_row"] = "roofline"
    batching: Literal["continuous", "static"] = "continuous"

    def __post_init__(self) -> None:
        where = f"pool {self.hw!r}"
        for name in ("replicas", "gpus_per_replica", "max_batch"):
            _check(getattr(self, name) >= 1, f"{where}: {name} must be >= 1")
        _check(0 < self.prefill_eff <= 1 and 0 < self.decode_eff <= 1,
               f"{where}: prefill_eff and decode_eff must be in (0, 1]")
        _check(self.overhead_s >= 0, f"{where}: overhead_s must be >= 0")
        _check(self.decode in ("roofline", "per_row"), f"{where}: decode must be "
                                                       f"'roofline' or 'per_row'")
        _check(self.batching in ("continuous", "static"),
               f"{where}: batching must be 'continuous' or 'static'")
        _check(self.batching == "static" or self.decode == "roofline",
               f"{where}: per_row pricing needs static batching")

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    def replica_class(self, catalog: Mapping[str, HardwareClass]) -> HardwareClass:
        """Peak figures of one replica (what the router is told)."""
        _check(self.hw in catalog, f"pool {self.hw!r}: not in the hardware catalog "
                                   f"{sorted(catalog)}")
        c = catalog[self.hw]
        n = self.gpus_per_replica
        return c.model_copy(update={"peak_tflops": c.peak_tflops * n,
                                    "mem_bw_gbs": c.mem_bw_gbs * n})


@dataclass(frozen=True)
class RoutingModel:
    """The real Router's settings (rollart.routing.router): defaults as `routing:` in a run
    config, prefix caching on (vLLM's automatic prefix caching)."""

    policy: Policy = "affinity"
    sticky: bool = True
    imbalance_threshold_s: float = 1.0
    prefix_cache: bool = True
    # Replicas per router shard (None: one router over all). A sharded rollout service: each
    # shard owns every K-th replica and its share of the episodes; it keeps routing O(shard).
    shard_replicas: int | None = None

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, f"routing.policy must be one of {POLICIES}")
        _check(self.shard_replicas is None or self.shard_replicas >= 1,
               "routing.shard_replicas must be >= 1")
        _check(self.imbalance_threshold_s >= 0, "routing.imbalance_threshold_s must be >= 0")


@dataclass(frozen=True)
class EnvModel:
    """Environment start-up before an episode's first turn. Each attempt takes `startup`
    seconds; with `startup_fail_prob` it fails, which is noticed after `startup_timeout_s` and
    retried (the env manager's job: the scheduler never sees it). Default: a sandbox container
    starting in ~10 s (assumption: Kubernetes' own SLO is 5 s for a stateless pod at the 99th
    percentile with the image cached; agent sandboxes with tool images are slower), no failures,
    a 60 s start-up timeout (assumption)."""

    startup: LatencyConfig = field(default_factory=lambda: LatencyConfig(median_s=10.0, sigma=0.5))
    startup_fail_prob: float = 0.0
    startup_timeout_s: float = 60.0
    max_attempts: int = 20  # a start that fails this often is given up as an episode failure

    def __post_init__(self) -> None:
        _check(0 <= self.startup_fail_prob < 1, "env.startup_fail_prob must be in [0, 1)")
        _check(self.startup_timeout_s >= 0, "env.startup_timeout_s must be >= 0")
        _check(self.max_attempts >= 1, "env.max_attempts must be >= 1")


@dataclass(frozen=True)
class TrainModel:
    """update_s = flops_per_param_token * params * tokens / (gpus * FLOP/s * mfu), params the
    active ones (an MoE trains only the experts each token visits). 8 = 6 for
    forward + backward (Kaplan et al. 2020) + 2 for the forward pass that recomputes the old
    policy's log-probs; tokens = every prompt and generated token of the batch's episodes.
    mfu 0.35: assumption (Megatron-LM reports 40-50 % on dense GPT training at scale; RL updates
    with variable-length sequences do worse)."""

    gpus: int
    hw: str = "H800"
    mfu: float = 0.35
    flops_per_param_token: float = 8.0

    def __post_init__(self) -> None:
        _check(self.gpus >= 1, "train.gpus must be >= 1")
        _check(0 < self.mfu <= 1, "train.mfu must be in (0, 1]")
        _check(self.flops_per_param_token > 0, "train.flops_per_param_token must be > 0")

    def update_s(self, tokens: float, params: float,
                 catalog: Mapping[str, HardwareClass]) -> float:
        _check(self.hw in catalog, f"train.hw {self.hw!r} is not in the hardware catalog")
        return (self.flops_per_param_token * params * tokens
                / (self.gpus * catalog[self.hw].flops * self.mfu))


@dataclass(frozen=True)
class SyncModel:
    """sync_s = latency_s + model bytes / (bandwidth_gbs * 1e9). 20 GB/s: backed out of verl's
    checkpoint-engine figure, a 235B model (470 GB in bf16) in 23.7 s on H20 (REFERENCE.md).
    Colocated engines reshard in GPU memory instead: use NVLink-class bandwidth there (400 GB/s,
    the H800's cut-down NVLink)."""

    bandwidth_gbs: float = 20.0
    latency_s: float = 0.5

    def __post_init__(self) -> None:
        _check(self.bandwidth_gbs > 0 and self.latency_s >= 0,
               "sync: bandwidth_gbs must be > 0, latency_s >= 0")

    def sync_s(self, weight_bytes: float) -> float:
        return self.latency_s + weight_bytes / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class SystemConfig:
    """sim: tasks (with token counts), rollout settings, iterations, seed; its `engine` gives the
    continuous batcher's gathering wait only, and its `trainer` the update and sync times when
    `train` / `sync` are None. colocated: engines and trainer share GPUs (monolithic), so the
    engines serve nothing during an update. sync_interrupts needs continuous batching."""

    sim: SimConfig
    pools: tuple[PoolModel, ...]
    model: ModelSpec = field(default_factory=ModelSpec)
    routing: RoutingModel = field(default_factory=RoutingModel)
    env: EnvModel | None = None
    reward: RewardModel | None = None
    train: TrainModel | None = None
    sync: SyncModel | None = None
    colocated: bool = False
    # The weight sync aborts turns in flight and re-issues them afterwards; False: it waits for
    # them to finish (what rollart's stages.sync_weights does today).
    sync_interrupts: bool = False
    catalog: Mapping[str, HardwareClass] = field(default_factory=lambda: dict(DEFAULT_CATALOG))

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        _check(len(self.pools) > 0, "pools: at least one engine pool")
        _check(self.sim.batching == "continuous",
               "the system simulator routes every turn: sim.batching must be 'continuous'")
        for p in self.pools:
            p.replica_class(self.catalog)  # raises on an unknown class
        if self.train is not None:
            _check(self.train.hw in self.catalog, f"train.hw {self.train.hw!r} is not in the "
                                                  f"hardware catalog")

    @property
    def engine_gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def gpus(self) -> int:
        """GPUs the configuration occupies (colocated: the trainer uses the engines' GPUs)."""
        if self.colocated or self.train is None:
            return self.engine_gpus
        return self.engine_gpus + self.train.gpus
