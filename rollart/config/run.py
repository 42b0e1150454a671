"""Typed run configuration, loaded from YAML and validated before anything starts: `RunConfig`
(every section, and the checks that need more than one), `load_config`, `config_from_dict`,
`dump_config`.

One small model per component; every model forbids unknown keys so a typo fails at load time with
the dotted path of the offending key. `load_config(path, overrides)` is the only entry point.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rollart.config.base import RUN_ID_RE, ConfigError, _Strict, apply_overrides
from rollart.config.cluster import ClusterConfig
from rollart.config.model import SHARDABLE_MODELS, SHARDABLE_TYPES, EngineConfig, ModelConfig
from rollart.config.sections import RewardConfig, RoutingConfig, StorageConfig
from rollart.config.tasks import KeyedValueError, check_tasks
from rollart.config.training import (
    AlgoConfig,
    EvalConfig,
    LoggingConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)
from rollart.cpu_pinning import class_cores
from rollart.routing.catalog import HardwareClass, default_catalog

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


def _seed_default_maps(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Give an override into one entry of a map of plain values (`cluster.workers.H800=2`) the
    map's defaults to change when the file does not set the map, so configs restate only what
    they change and `--set` still edits one entry (instead of replacing the map by that entry).
    Maps whose model merges entries over its defaults itself (`hardware`) are left alone."""
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        model: type[BaseModel] = RunConfig
        node: Any = data
        for part in parts[:-1]:
            field = model.model_fields.get(part)
            if field is None or not isinstance(node, dict):
                break
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                if node.get(part) is None:
                    node[part] = {}
                node, model = node[part], ann
                continue
            default = field.get_default(call_default_factory=True)
            if (isinstance(default, dict) and default and node.get(part) is None
                    and all(isinstance(v, (str, int, float)) for v in default.values())):
                node[part] = copy.deepcopy(default)
            break
    return data


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
    overrides = overrides or []
    return config_from_dict(apply_overrides(_seed_default_maps(data, overrides), overrides))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
