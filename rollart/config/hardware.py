"""Default hardware classes: the one home of the cluster a run gets when nothing says otherwise.

The run config's `cluster` defaults, the embedded Dask cluster (`infra/dask_cluster.py`), the
local stack (`infra/stack.py`) and the Prefect `DaskCluster` block all start from these, so
changing the default classes is one edit here. Read-only views: callers take a copy through
`default_workers()` / `default_stages()` so that no one mutates the shared default.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# Hardware class (= Dask resource name) -> worker count on the embedded cluster: one
# compute-optimised GPU class (trainer, prefill), one bandwidth-optimised (decode), one CPU pool.
DEFAULT_WORKERS: Mapping[str, int] = MappingProxyType({"H800": 1, "H20": 1, "CPU": 1})

# Stage -> hardware class (DESIGN.md, "The problem": best-fit class per stage).
DEFAULT_STAGES: Mapping[str, str] = MappingProxyType(
    {"trainer": "H800", "engine": "H20", "env": "CPU", "reward": "CPU"}
)


def default_workers() -> dict[str, int]:
    """A fresh, mutable copy of `DEFAULT_WORKERS`."""
    return dict(DEFAULT_WORKERS)


def default_stages() -> dict[str, str]:
    """A fresh, mutable copy of `DEFAULT_STAGES`."""
    return dict(DEFAULT_STAGES)


def worker_classes(client: Any) -> dict[str, list[str]]:
    """Hardware class -> worker addresses of a running cluster (a `distributed.Client`), from
    the scheduler's view of worker resources."""
    out: dict[str, list[str]] = {}
    for addr, info in client.scheduler_info(n_workers=-1)["workers"].items():
        for res in info.get("resources", {}):
            out.setdefault(res, []).append(addr)
    return out
