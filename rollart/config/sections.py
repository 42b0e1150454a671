"""Config sections for the external services (rewards on Lambda, the store) and for routing.

Part of the `rollart.config` package; import them from `rollart.config`, which
re-exports them. Same rules: unknown keys fail, errors say how to fix them.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, model_validator

from rollart.config.base import _Strict


class RewardConfig(_Strict):
    """How episodes are scored. `local` runs the handler on this machine, in a warm process
    with a hard timeout and a memory cap (rollart/rewards/guard.py); `lambda` invokes an AWS
    Lambda function (real AWS, or the local endpoint through `endpoint_url`) as each episode
    finishes. Credentials never live here: boto3 reads AWS_ACCESS_KEY_ID/... or a profile."""

    backend: Literal["local", "lambda"] = "local"
    """`local`: the handler runs on the scoring worker in a bounded child process; `lambda`: an AWS
    Lambda invoke per episode (real AWS, or the local endpoint)."""
    embedded_endpoint: bool = True
    """backend `lambda` with no endpoint_url: the run starts the local Lambda endpoint (loopback,
    awslambdaric workers, scale to zero) and registers `function` under the Lambda name."""
    function: str = "env_outcome"
    """handler name (registry) or dotted module.function path."""
    function_name: str | None = None
    """Lambda function name or ARN; None: `function`."""
    alias: str | None = None
    """Lambda qualifier: alias name or version number."""
    endpoint_url: str | None = None
    """None: real AWS; http://127.0.0.1:PORT: local endpoint."""
    region: str = "us-east-1"
    """AWS region of the Lambda function."""
    max_concurrency: int = Field(32, ge=1, le=1000)
    """invocations in flight from this client."""
    timeout_s: float = Field(60.0, gt=0.0, le=900.0)
    """Per call, wherever the handler runs: `local` kills its process past it (a hard timeout that
    works off the main thread); the embedded endpoint uses it as the function timeout; a Lambda
    client as its socket read timeout."""
    memory_mb: int = Field(2048, ge=128, le=10240)
    """Memory cap of a handler's process (MiB): `local` handler processes and the embedded
    endpoint's function; past it the call fails like any handler error (`on_error`)."""
    retry_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Transient failures (throttles, 5xx, timeouts, endpoint down or restarting) are retried for
    this long per episode, so an endpoint restart or a throttling burst costs latency, not the run;
    past it the episode's reward fails with RewardError."""
    max_retries: int = Field(5, ge=0, le=50)
    """per episode, for handler errors (on_error=retry)"""
    on_error: Literal["retry", "zero", "fail"] = "retry"
    """A handler error (FunctionError; locally also a timeout, memory or crash): retry (then fail),
    score 0 and flag it, or fail the run."""
    backoff_base_s: float = Field(0.05, gt=0.0)
    """jittered exponential backoff: base ..."""
    backoff_max_s: float = Field(2.0, gt=0.0)
    """... and cap: a few seconds, so a restarted endpoint is noticed soon after it is back."""

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        import re

        from rollart.rewards.registry import known_handler

        lambda_name = r"^(arn:aws[a-zA-Z-]*:lambda:[a-z0-9-]+:\d{12}:function:)?[\w-]{1,64}$"
        qualifier = r"^(\$LATEST|[0-9]+|[\w-]*[a-zA-Z_-][\w-]*)$"

        runs_here = self.backend == "local" or (
            self.embedded_endpoint and self.endpoint_url is None)  # our endpoint runs it
        if runs_here and not known_handler(self.function):
            from rollart.rewards.registry import HANDLERS

            raise ValueError(
                f"reward.function {self.function!r} is not a known handler; known: "
                f"{sorted(HANDLERS)} (or a dotted module.function path)"
            )
        if self.backend == "lambda":
            name = self.function_name or self.function
            if not re.match(lambda_name, name, re.ASCII):
                raise ValueError(
                    f"reward.function_name {name!r} is not a Lambda function name or ARN "
                    "(letters, digits, - and _, at most 64)"
                )
        if self.alias is not None and not re.match(qualifier, self.alias, re.ASCII):
            raise ValueError(f"reward.alias {self.alias!r} must be an alias name or a version")
        if self.endpoint_url is not None and not re.match(r"^https?://[^/\s]+", self.endpoint_url):
            raise ValueError("reward.endpoint_url must look like http://host:port (or null)")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("reward.backoff_max_s must be >= reward.backoff_base_s")
        return self

    @property
    def lambda_name(self) -> str:
        return self.function_name or self.function


class StorageConfig(_Strict):
    """Where the run's store lives and how it is reached. Same code for a local path, `file://`
    and `s3://bucket/prefix` (AWS S3, SeaweedFS, MinIO, any S3-compatible endpoint).

    Credentials never live here: they come from the environment (AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY, or a profile) or from a Prefect Secret block named by
    `credentials_block` whose value is {"aws_access_key_id": ..., "aws_secret_access_key": ...},
    or a prefect-aws AwsCredentials block of that name.
    """

    root: str = "artifacts"
    """local path or fsspec URL (file://..., s3://bucket/prefix)"""
    save_every: int = Field(5, gt=0)
    """checkpoint every N iterations (and after the last)"""
    keep_last: int = Field(2, gt=0)
    """retention: complete checkpoints kept."""
    shards: bool = True
    """write trajectory shards (Parquet), off the critical path."""
    background_upload: bool = True
    """upload checkpoints in the background (False: block)"""
    endpoint_url: str | None = None
    """S3 only. endpoint_url None: AWS (or AWS_ENDPOINT_URL_S3 from the environment)."""
    region: str | None = None
    """None: AWS_REGION / AWS_DEFAULT_REGION / profile, else us-east-1."""
    profile: str | None = None
    """AWS shared-credentials profile name."""
    credentials_block: str | None = None
    """Prefect Secret block name (the name, never the key)"""
    create_bucket: bool = False
    """create the bucket at start when it does not exist."""
    retry_timeout_s: float = Field(120.0, gt=0.0)
    """keep retrying transient errors this long."""
    lock_ttl_s: float = Field(60.0, ge=5.0)
    """Object stores: the run's writer lock (runs/{id}/run.lock) is refreshed every third of this
    and counts as its holder's death (stale) once older; local stores use flock instead."""
    weights_every: int = Field(0, ge=0)
    """Weight versions in the store (weights/v{n}/): publish every N versions (0: never) in the
    background; `sync_via_store` makes engines pull each version from the store instead of the
    direct trainer -> engine transfer (engines on another cluster)."""
    weights_keep_last: int = Field(2, gt=0)
    """Weight versions kept under weights/ when weights_every is set."""
    sync_via_store: bool = False
    """Engines pull each new weight version from the store instead of receiving it from the trainer
    directly."""

    @model_validator(mode="after")
    def _check(self) -> StorageConfig:
        import re

        root = self.root.strip()
        if not root:
            raise ValueError("storage.root must be a directory or a URL such as s3://bucket/prefix")
        scheme = root.split("://", 1)[0].lower() if "://" in root else "file"
        if scheme in ("s3", "s3a"):
            bucket = root.split("://", 1)[1].split("/", 1)[0]
            if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
                raise ValueError(
                    f"storage.root {root!r}: S3 bucket name {bucket!r} is not valid (3-63 "
                    "lowercase letters, digits, '.' and '-')"
                )
        elif self.endpoint_url or self.region or self.profile or self.credentials_block:
            raise ValueError(
                "storage.endpoint_url/region/profile/credentials_block apply to s3:// roots "
                f"only, but storage.root is {root!r}"
            )
        if self.endpoint_url is not None and not re.match(r"^https?://[^/\s]+/?$",
                                                          self.endpoint_url):
            raise ValueError("storage.endpoint_url must look like http(s)://host[:port] (or null)")
        if self.credentials_block is not None and not re.fullmatch(
                r"[a-z0-9][a-z0-9-]*", self.credentials_block):
            raise ValueError(
                "storage.credentials_block is the *name* of a Prefect Secret block (lowercase "
                "letters, digits and '-'), never the secret itself"
            )
        if self.credentials_block and self.profile:
            raise ValueError("set storage.credentials_block or storage.profile, not both")
        return self


class SlowdownConfig(_Strict):
    """Emulation factors for one class: its prefill / decode steps take this many times the
    measured host time (>= 1; emulation can only slow a replica down)."""

    prefill: float = Field(1.0, ge=1.0)
    """Factor on the measured prefill time (>= 1)."""
    decode: float = Field(1.0, ge=1.0)
    """Factor on the measured decode time (>= 1)."""


class EmulationConfig(_Strict):
    """Emulated heterogeneity (benchmarks): on one CPU host every engine pool is the same
    hardware. Off by default; never on in a real cluster (HF engine only).
    mode `modelled`: every forward pass takes the cost model's time for the replica's class
    (rollart.routing.emulation.ServiceModel), spent as sleep; the real pass still runs unless
    `forward: false`. mode `slowdown` (legacy): sleep (factor - 1) x the measured pass time."""

    enabled: bool = False
    """Emulate the pools' hardware classes on one host (benchmarks only; HF engine)."""
    mode: Literal["modelled", "slowdown"] = "modelled"
    """`modelled`: each pass takes the cost model's time for the class; `slowdown`: sleep (factor -
    1) x the measured pass time."""
    model_params: float | None = Field(None, gt=0.0)
    """modelled model size; None: the served one."""
    bytes_per_param: float = Field(2.0, gt=0.0)
    """modelled weights (bf16)"""
    time_scale: float = Field(1.0, gt=0.0)
    """wall seconds per modelled second."""
    forward: bool = True
    """run the real forward pass (real tokens and log-probs)"""
    factors: dict[str, SlowdownConfig] = {}
    """slowdown mode: explicit factors per class; classes not listed get factors derived from
    `hardware` (rollart.routing.catalog.emulation_slowdowns: fastest class per phase = 1)."""

    @model_validator(mode="after")
    def _check(self) -> EmulationConfig:
        if self.factors and self.mode != "slowdown":
            raise ValueError("routing.emulation.factors apply to mode: slowdown only")
        return self


class RoutingConfig(_Strict):
    """How generation requests are mapped to engine replicas (rollart.routing.router)."""

    policy: Literal["affinity", "round_robin", "least_loaded"] = "affinity"
    """`affinity`: place each turn where its estimated cost is lowest (prefill-heavy turns on
    compute-class pools, decode-heavy on bandwidth-class); `round_robin`; `least_loaded`."""
    sticky: bool = True
    """Keep an episode on its replica across turns (prefix-cache reuse) unless that replica's
    estimated wait exceeds the smallest wait by more than imbalance_threshold_s."""
    imbalance_threshold_s: float = Field(1.0, ge=0.0)
    """A sticky episode moves off its replica once that replica's estimated wait exceeds the
    smallest by more than this."""
    prefix_cache: bool | None = None
    """engines reuse cached prefixes; None: from engine.backend."""
    decode_batch: int = Field(8, gt=0)
    """rows sharing one weight read per decode step (cost model)"""
    profile_alpha: float = Field(0.2, gt=0.0, le=1.0)
    """EMA weight of task profiles."""
    correction_bound: float | None = Field(None, ge=1.0)
    """Online correction: how far one replica's estimates may move relative to the others' (see
    rollart.routing.router); None: derived from the pools' classes (H800 + H20: 1.045)."""
    emulation: EmulationConfig = EmulationConfig()
    """Emulated heterogeneity for benchmarks on one host."""


class LatencyConfig(_Strict):
    """Injected env step latency that stands for slow tools or sandboxes (a heavy tail):
    every step sleeps lognormal(median_s, sigma); with probability tail_prob it also stalls
    for tail_s x Pareto(tail_alpha) (>= tail_s, mean tail_s * a / (a - 1))."""

    median_s: float = Field(0.0, ge=0.0)
    """Median of the lognormal step latency, seconds (0: no latency)."""
    sigma: float = Field(0.5, ge=0.0)
    """Lognormal shape of the step latency."""
    tail_prob: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a step also stalls (the heavy tail)."""
    tail_s: float = Field(0.0, ge=0.0)
    """Scale of a stall, seconds: a stall lasts tail_s x Pareto(tail_alpha)."""
    tail_alpha: float = Field(2.0, gt=1.0)
    """Pareto shape of the stalls (> 1; smaller is heavier)."""

    def sample(self, rng: random.Random) -> float:
        """One step's delay in seconds. LatencyEnv sleeps it; the simulator (rollart/sim) adds
        it to simulated time, so both draw from the same distribution by construction."""
        d = self.median_s * rng.lognormvariate(0.0, self.sigma) if self.median_s else 0.0
        if self.tail_prob and rng.random() < self.tail_prob:
            d += self.tail_s * rng.paretovariate(self.tail_alpha)
        return d


class FaultConfig(_Strict):
    """Injected env failures (chaos testing): each step raises with `step_error_rate`; the
    `hang_at_step`-th step a worker process runs for this task hangs for `hang_s` seconds."""

    step_error_rate: float = Field(0.0, ge=0.0, lt=1.0)
    """Probability that an env step raises."""
    hang_at_step: int | None = Field(None, gt=0)
    """The step (counted per task in each worker process) that hangs; None: no hang."""
    hang_s: float = Field(3600.0, gt=0.0)
    """How long the hanging step hangs, seconds."""
