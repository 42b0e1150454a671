"""The rollout service's per-batch metrics (`rollout/...`, `perf/engine_busy_s`)."""

from __future__ import annotations

import time
from typing import Any

from rollart.metrics import TrajStats, rollout_metrics, traj_stats
from rollart.types import Trajectory


def service_metrics(svc: Any, trajs: list[Trajectory], stats: list[TrajStats] | None = None
                    ) -> dict[str, float]:
    """Metrics of a batch `trajs` taken from RolloutService `svc` (its counters since the
    start; `rollout/failed` since the previous batch); `stats`: their `traj_stats`."""
    if stats is None:
        stats = [traj_stats(t) for t in trajs]
    m = rollout_metrics(trajs, stats=stats)
    c = svc.totals.counters + svc.sched.counters
    for key in ("timeouts", "retried", "cancelled_redundant", "cancelled_stale",
                "cancelled_group_dropped", "groups_dropped_failures", "dropped_stale_groups",
                "hosts_lost", "late_results", "engine_errors", "turns_reissued",
                "engines_replaced", "groups_resampled", "resampled_model_tokens",
                "resampled_env_steps"):
        m[f"rollout/{key}"] = float(c[key])
    # A failed episode is re-issued, never batched, so the batch itself holds none: per batch
    # is the failures since the previous batch; the run's count is `failed_total`.
    m["rollout/failed"] = float(c["failed"] - svc._failed_reported)
    m["rollout/failed_total"] = float(c["failed"])
    svc._failed_reported = c["failed"]
    stale = c["cancelled_stale"] + c["dropped_stale_episodes"]
    m["rollout/dropped_stale_episodes"] = float(stale)
    m["rollout/engines_lost"] = float(svc.health.lost_total)
    m["rollout/engines_serving"] = float(len(svc.health.alive_indices()))
    m["rollout/in_flight"] = float(len(svc.live))
    m["rollout/groups_ready"] = float(len(svc.sched.complete))
    versions = [s.start_version for s in stats if s.start_version >= 0]
    if versions:
        m["rollout/start_version_min"] = float(min(versions))
    m.update(svc.routing.metrics())
    m["perf/engine_busy_s"] = sum(b.busy_s for b in svc.batchers)
    m["perf/rollout_elapsed_s"] = time.perf_counter() - svc.started_at
    return m
