"""Typed run configuration: `load_config(path, overrides)` reads a YAML file into a `RunConfig`,
validated before anything starts (unknown keys fail with their dotted path).

Import every name from `rollart.config`; the submodules only keep each file small:

    base       `_Strict` (the base model), `ConfigError`, run ids, `--set key.path=value`
    hardware   the default hardware classes (workers per class, class per stage)
    cluster    `cluster:` where stages run (local, address, slurm, kubernetes)
    sections   `reward:`, `storage:`, `routing:` and the emulation sections
    model      `model:`, `engine:`
    training   `tasks:`, `rollout:`, `algo:`, `train:`, `eval:`, `logging:`
    tasks      checks of `tasks:` across tasks (env ids, shares)
    run        `RunConfig`, `load_config`, `config_from_dict`, `dump_config`

Rule (tests/unit/test_architecture.py): this package imports no other part of rollart except the
few leaf modules its validators need (`rollart.cpu_pinning`, `rollart.routing.catalog`,
`rollart.rewards.registry` lazily), so every other package can import it. The defaults of
`rollout.*` live here only (`rollout_defaults()`): the rollout scheduler's `SchedulerConfig` and
the simulator's `SimConfig` take theirs from it.
"""

from rollart.config.base import (
    RUN_ID_RE,
    ConfigError,
    _Strict,
    apply_overrides,
    check_overrides,
    check_run_id,
)
from rollart.config.cluster import ClusterConfig
from rollart.config.model import (
    SHARDABLE_MODELS,
    SHARDABLE_TYPES,
    EngineConfig,
    ModelConfig,
    TinyModelConfig,
    VLLMEngineConfig,
)
from rollart.config.run import RunConfig, _format_error, config_from_dict, dump_config, load_config
from rollart.config.sections import (
    EmulationConfig,
    FaultConfig,
    LatencyConfig,
    RewardConfig,
    RoutingConfig,
    SlowdownConfig,
    StorageConfig,
)
from rollart.config.tasks import KeyedValueError, check_tasks, split_by_share
from rollart.config.training import (
    AlgoConfig,
    EvalConfig,
    LoggingConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    rollout_defaults,
)

__all__ = [
    "RUN_ID_RE", "SHARDABLE_MODELS", "SHARDABLE_TYPES", "AlgoConfig", "ClusterConfig",
    "ConfigError", "EmulationConfig", "EngineConfig", "EvalConfig", "FaultConfig",
    "KeyedValueError", "LatencyConfig", "LoggingConfig", "ModelConfig", "RewardConfig",
    "RolloutConfig", "RoutingConfig", "RunConfig", "SlowdownConfig", "StorageConfig",
    "TaskConfig", "TinyModelConfig", "TrainConfig", "VLLMEngineConfig", "_Strict",
    "_format_error", "apply_overrides", "check_overrides", "check_run_id", "check_tasks",
    "config_from_dict", "dump_config", "load_config", "rollout_defaults", "split_by_share",
]
