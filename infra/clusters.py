"""The Dask cluster a run gets, by `cluster.manager` (rollart/config/cluster.py).

    local        HardwareClassCluster: one worker process per class on loopback
    address      the scheduler at `cluster.address` (its workers carry the class resources)
    slurm        infra/slurm.SlurmClassCluster: workers as Slurm jobs, env class adaptive
    kubernetes   infra/kubernetes.KubeClassCluster: a DaskCluster via the operator

An explicit `scheduler_address` (the CLI's --scheduler, a flow parameter) wins over all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rollart.config.cluster import ClusterConfig


@dataclass(frozen=True)
class ClusterHandle:
    address: str
    dashboard: str | None
    manager: str


@contextlib.contextmanager
def open_cluster(cfg: ClusterConfig, scheduler_address: str | None = None,
                 dashboard: bool | None = None) -> Iterator[ClusterHandle]:
    """Start (or connect to) the run's cluster; stop what was started on exit, also on error.

    TLS (infra/dask_tls.py): the local cluster gets fresh certificates for this run (unless
    `cluster.tls` is false); a `tls://` address of the local stack (`rollart up`) uses the
    stack's certificates. Slurm and Kubernetes clusters use the site's own Dask settings."""
    from infra import dask_tls

    if scheduler_address or cfg.manager == "address":
        address = scheduler_address or cfg.address
        assert address is not None  # config validation: manager "address" needs one
        with contextlib.ExitStack() as stack:
            dask_tls.connect_existing(stack, address)
            yield ClusterHandle(address, None, "address")
        return
    show = cfg.dashboard if dashboard is None else dashboard
    if cfg.manager == "local":
        from infra.dask_cluster import HardwareClassCluster

        with contextlib.ExitStack() as stack:
            local = stack.enter_context(HardwareClassCluster(
                workers=cfg.workers, threads_per_worker=cfg.threads_per_worker,
                dashboard=show, security=dask_tls.embedded(stack, cfg.tls)))
            yield ClusterHandle(local.scheduler_address, local.dashboard_link if show else None,
                                "local")
        return
    if cfg.manager == "slurm":
        from infra.slurm import SlurmClassCluster

        with SlurmClassCluster(cfg) as slurm:
            yield ClusterHandle(slurm.scheduler_address, slurm.dashboard_link, "slurm")
        return
    from infra.kubernetes import KubeClassCluster

    with KubeClassCluster(cfg) as kube:
        yield ClusterHandle(kube.scheduler_address, kube.dashboard_link, "kubernetes")
