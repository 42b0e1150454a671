"""Service handles: a long-lived service is a Dask actor in a run and a plain object in tests,
benchmarks and the in-process mode. These helpers hide the difference.
"""

from __future__ import annotations

from typing import Any


def call(handle: Any, method: str, *args: Any) -> Any:
    """A Dask actor call (returns a future) or a plain method call, uniformly."""
    out = getattr(handle, method)(*args)
    return out.result() if hasattr(out, "result") and callable(out.result) else out


def worker_identity() -> dict[str, Any]:
    """Name and resources of the Dask worker running the caller (empty outside a worker)."""
    try:
        from distributed import get_worker

        w = get_worker()
        return {"worker": w.name, "address": w.address, "resources": dict(w.state.total_resources)}
    except (ImportError, ValueError):
        return {"worker": None, "address": None, "resources": {}}
