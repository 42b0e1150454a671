"""Build the routing pieces from a RunConfig (kept out of rollart.routing's __init__ because
rollart.config imports the catalog from this package)."""

from __future__ import annotations

from rollart.config import RunConfig
from rollart.config.hardware import DEFAULT_STAGES
from rollart.routing.catalog import Slowdown, emulation_slowdowns
from rollart.routing.emulation import ServiceModel
from rollart.routing.profile import TaskProfiles
from rollart.routing.router import CostModel, ReplicaSpec, Router


def engine_replica_id(index: int) -> str:
    """The router's id of engine replica `index` (also the key of its `router/...` metrics).
    Callers never parse it back: a routing decision carries the index (`Decision.replica_index`)."""
    return f"engine-{index}"


def engine_replicas(cfg: RunConfig) -> list[ReplicaSpec]:
    """One spec per engine replica, in replica order (the order the rollout service creates its
    engine actors in), so a decision's `replica_index` is the engine's index. A class missing
    from the catalog (single-pool configs may name any class) falls back to the default engine
    class's figures: with one pool nothing is chosen by them."""
    classes = cfg.cluster.engine_classes(cfg.engine.replicas)
    fallback = cfg.hardware[DEFAULT_STAGES["engine"]]
    return [ReplicaSpec(engine_replica_id(i), cfg.hardware.get(c) or fallback)
            for i, c in enumerate(classes)]


def prefix_cache_enabled(cfg: RunConfig) -> bool:
    """Explicit `routing.prefix_cache`, else the backend's habit: the HF engine re-prefills the
    whole context every turn; vLLM caches prefixes."""
    if cfg.routing.prefix_cache is not None:
        return cfg.routing.prefix_cache
    return cfg.engine.backend != "hf"


def build_router(cfg: RunConfig, params: float, bytes_per_param: float | None = None) -> Router:
    """params: the policy's parameter count (rollart.models.param_count). Under modelled
    emulation the cost model is the emulation's (its model size, bytes per parameter and time
    scale), so estimates are in the wall seconds the emulated engines will take."""
    em = cfg.routing.emulation
    time_scale = 1.0
    if em.enabled and em.mode == "modelled":
        params = em.model_params or params
        bytes_per_param, time_scale = em.bytes_per_param, em.time_scale
    if bytes_per_param is None:
        bytes_per_param = 4.0 if cfg.model.dtype == "float32" else 2.0
    cost = CostModel.for_model(params, bytes_per_param, decode_batch=cfg.routing.decode_batch,
                               time_scale=time_scale)
    r = cfg.routing
    return Router(engine_replicas(cfg), cost, policy=r.policy, sticky=r.sticky,
                  imbalance_threshold_s=r.imbalance_threshold_s,
                  prefix_cache=prefix_cache_enabled(cfg), correction_bound=r.correction_bound)


def emulation_factors(cfg: RunConfig) -> dict[str, Slowdown | ServiceModel]:
    """What each engine class emulates when `routing.emulation.enabled` (else {}): mode
    `modelled`, a ServiceModel of the class's catalog figures (params None: the engine uses its
    own model's count); mode `slowdown`, factors derived from the catalog across the engine
    pools' classes, overridden by explicit `routing.emulation.factors`."""
    em = cfg.routing.emulation
    if not em.enabled:
        return {}
    classes = sorted(set(cfg.cluster.engine_classes(cfg.engine.replicas)))
    if em.mode == "modelled":
        hw = {c: cfg.hardware.get(c) or cfg.hardware[DEFAULT_STAGES["engine"]] for c in classes}
        return {c: ServiceModel(hw[c], em.model_params, em.bytes_per_param, em.time_scale,
                                em.forward) for c in classes}
    out: dict[str, Slowdown | ServiceModel] = dict(
        emulation_slowdowns(cfg.hardware[c] for c in classes if c in cfg.hardware))
    out.update({c: Slowdown(f.prefill, f.decode) for c, f in em.factors.items()})
    return out


def task_profiles(cfg: RunConfig) -> TaskProfiles:
    """Unseen tasks are routed as if they decode `engine.max_new_tokens` tokens per turn."""
    return TaskProfiles(alpha=cfg.routing.profile_alpha,
                        prior_decode_tokens=float(cfg.engine.max_new_tokens))
