"""Hardware-affinity workload mapping: hardware catalog, task profiles, router (all pure)."""

from rollart.routing.catalog import (
    DEFAULT_CATALOG,
    HardwareClass,
    Slowdown,
    default_catalog,
    emulated_class,
    emulation_slowdowns,
    host_matched_slowdowns,
)
from rollart.routing.emulation import ServiceModel
from rollart.routing.profile import TaskProfiles
from rollart.routing.router import (
    POLICIES,
    CostModel,
    Decision,
    NoHealthyReplica,
    ReplicaSpec,
    Router,
    RouteRequest,
    default_correction_bound,
)

__all__ = [
    "DEFAULT_CATALOG",
    "POLICIES",
    "CostModel",
    "Decision",
    "HardwareClass",
    "NoHealthyReplica",
    "ReplicaSpec",
    "RouteRequest",
    "Router",
    "ServiceModel",
    "Slowdown",
    "TaskProfiles",
    "default_catalog",
    "default_correction_bound",
    "emulated_class",
    "emulation_slowdowns",
    "host_matched_slowdowns",
]
