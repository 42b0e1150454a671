"""Embedded Dask cluster whose workers carry hardware-class resources.

One machine plays every class: each worker is a separate process (Nanny) that advertises one
resource named after its class (`H800=1`, `H20=1`, `CPU=1`), so a submission annotated with
`resources={"H20": 1}` can only land on an H20-class worker. The same code, pointed at a real
scheduler address, runs on a cluster whose workers were started with `dask worker --resources`.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Literal

import dask
from distributed import Nanny, Scheduler, Security, SpecCluster, Worker

from rollart.config.hardware import default_workers, worker_classes

# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in every worker it spawns (glibc hands freed
# memory back to the OS eagerly). Rollart's workers keep what they freed instead: one malloc
# arena (a worker's tasks and actor calls run on threads other than the main one, whose arenas
# give memory back by themselves), no trimming, no mmap'd chunks (each would be unmapped when
# freed). A trainer update on SmolLM2-135M peaks at ~6 GB; with glibc's default policy
# each update re-faulted ~0.5 M pages the previous one had freed, and a fault costs ~7-20 us of
# system time on the VMs here (benchmarks/trainer_heap.py -> results/trainer_heap.json). The
# price: a worker's resident memory stays at its peak, which for a trainer or an engine is what
# the next step needs anyway. Torch thread counts: set in the thread that runs the work (see
# rollart/services/engine.py), not by OMP_NUM_THREADS here.
WORKER_ENVIRON = {
    "MALLOC_TRIM_THRESHOLD_": 1 << 40,
    "MALLOC_ARENA_MAX": 1,
    "MALLOC_MMAP_MAX_": 0,
    "OMP_NUM_THREADS": 1,
    "MKL_NUM_THREADS": 1,
    "OPENBLAS_NUM_THREADS": 1,
}


def configure_worker_environ() -> None:
    dask.config.set({"distributed.nanny.pre-spawn-environ": dict(WORKER_ENVIRON)})


class PatientNanny(Nanny):
    """A worker process that holds torch, transformers and a model takes a few seconds to exit
    on a busy 2-core host; Nanny's default (5 s, of which 4 s to exit before it kills) logged
    "still alive ..., killing" at the end of every successful run. Give it 20 s."""

    async def close(self, timeout: float = 20, reason: str = "nanny-close") -> Literal["OK"]:
        return await super().close(timeout=max(timeout, 20), reason=reason)


class QuickExitWorker(Worker):
    """A worker whose process, after the worker closed cleanly, exits without the interpreter's
    teardown.

    At exit Python joins the threads, runs every atexit handler and weakref finalizer (the
    cleanups that matter outside the process: temp directories, the trainer's shared-memory
    weights, reward sandboxes, Dask's work directory), then tears down every module's objects.
    For a process that imported torch, transformers and vLLM that last part is native work that
    changes nothing outside it, and a run's command waits for every worker process to exit
    (with the vLLM engine's own exit path, rollart/engines/vllm_engine.py, a run's end went
    from 6.9 to 3.7 s on a 2-core host: results/startup_smollm2_exit.json). So a clean close
    registers `_exit_after_cleanups`, the last atexit handler, which therefore runs first: it
    runs every other handler (finalizers included) exactly once, as a normal exit would, and
    then leaves with `os._exit(0)`. A worker that did not close cleanly exits the normal way,
    with its own exit code."""

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        result = await super().close(*args, **kwargs)
        atexit.register(_exit_after_cleanups)
        return result


def _exit_after_cleanups() -> None:
    atexit.unregister(_exit_after_cleanups)  # the call below runs every other handler once
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(0)


def worker_spec(workers: dict[str, int], threads_per_worker: int = 1,
                security: Security | None = None) -> dict[str, dict]:
    """Spec for SpecCluster: one entry per worker, named `{class}-{i}`, resource `{class}: 1`.
    Each worker's HTTP server (/metrics, /health) on loopback: its default is every interface."""
    spec: dict[str, dict] = {}
    tls = {"security": security, "protocol": "tls"} if security else {}
    for hw_class, count in workers.items():
        for i in range(count):
            spec[f"{hw_class}-{i}"] = {
                "cls": PatientNanny,
                "options": {
                    "worker_class": QuickExitWorker,
                    "nthreads": threads_per_worker,
                    "resources": {hw_class: 1},
                    "memory_limit": 0,  # the machine is shared by every class; do not pause
                    "name": f"{hw_class}-{i}",
                    "host": "127.0.0.1",
                    "dashboard_address": "127.0.0.1:0",
                    **tls,
                },
            }
    return spec


class HardwareClassCluster(SpecCluster):
    """LocalCluster-like SpecCluster with heterogeneous, resource-tagged workers on loopback.
    With `security` (infra/dask_tls.py) every listener speaks TLS and requires a certificate
    from the run's CA; `scheduler_address` is then `tls://...`."""

    def __init__(
        self,
        workers: dict[str, int] | None = None,
        threads_per_worker: int = 1,
        dashboard: bool = True,
        security: Security | None = None,
        **kwargs,
    ) -> None:
        workers = workers or default_workers()
        # Torch in every worker process would otherwise grab every core; stages set their own.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        configure_worker_environ()
        scheduler = {
            "cls": Scheduler,
            "options": {
                "host": "127.0.0.1",
                "port": 0,
                "dashboard_address": "127.0.0.1:0" if dashboard else None,
                "dashboard": dashboard,
                **({"security": security, "protocol": "tls"} if security else {}),
            },
        }
        super().__init__(
            workers=worker_spec(workers, threads_per_worker, security),
            scheduler=scheduler,
            security=security,
            name="rollart-embedded",
            **kwargs,
        )


__all__ = ["HardwareClassCluster", "PatientNanny", "QuickExitWorker", "worker_classes",
           "worker_spec"]
