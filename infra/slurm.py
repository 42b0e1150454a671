"""`cluster.manager: slurm`: hardware-class Dask workers started as Slurm jobs (dask-jobqueue).

One scheduler, in the run's process. Every worker is one Slurm job carrying
`--resources CLASS=1`, with its class's job directives (GPU type through `--gres` or
`--constraint`, cores, memory, partition, walltime):

- the env class (CPU) is a `SLURMCluster` named after the class: its jobs are what `scale` and
  `adapt` add and remove, so the env pool grows and shrinks between `cluster.slurm.adapt` bounds
  (infra/scaling.ClassAdaptive; a worker holding a service is never retired);
- every other class (trainer, engines) is a fixed set of `SLURMJob`s submitted against the same
  scheduler. Plain `scale`/`adapt` know one job template only, so they could neither start a
  class-specific job nor be trusted not to cancel a GPU worker (DESIGN.md).

Workers must see this checkout at the same path and run `slurm.python` (default: the run's own
interpreter); each job exports the submitting environment (sbatch's default), so PYTHONPATH,
credentials and the Lambda endpoint's key pair reach the workers as they reach local ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from dask_jobqueue import SLURMCluster
from dask_jobqueue.slurm import SLURMJob

from infra.dask_cluster import WORKER_ENVIRON
from infra.scaling import ClassAdaptive, KeepServiceWorkers
from rollart.config.cluster import ClusterConfig


def job_kwargs(cfg: ClusterConfig, hw_class: str) -> dict[str, Any]:
    """dask-jobqueue Job options for one worker of `hw_class` (one worker per job)."""
    s, c = cfg.slurm, cfg.class_settings(hw_class)
    directives = list(c.directives) + ([f"--gres={c.gres}"] if c.gres else [])
    exports = [f"export {k}={v}" for k, v in WORKER_ENVIRON.items() if v is not None]
    return {
        "cores": c.cores,
        "memory": c.memory,
        "processes": 1,
        "queue": c.partition or s.partition,
        "account": s.account,
        "walltime": c.walltime or s.walltime,
        "python": s.python or sys.executable,
        "interface": s.interface,
        "job_name": f"rollart-{hw_class}",
        "job_extra_directives": directives,
        "worker_extra_args": ["--resources", f"{hw_class}=1"],
        # Same checkout path on every node: workers import this project from here.
        "job_script_prologue": [f"cd {os.getcwd()}", *exports, *s.prologue],
        "log_directory": s.log_directory,
        # A worker whose scheduler is gone (run ended or crashed) exits and frees its job.
        "death_timeout": 60,
    }


class SlurmClassCluster:
    """Context manager: the scheduler here, `cfg.workers[c]` Slurm jobs per class, the env
    class adaptive. `scheduler_address` and `dashboard_link` as on a Dask cluster object."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.pool_class = cfg.stages["env"]
        self.jobs: dict[str, SLURMJob] = {}  # name -> job, the fixed classes
        self.cluster: SLURMCluster | None = None

    @property
    def scheduler_address(self) -> str:
        assert self.cluster is not None
        return self.cluster.scheduler_address

    @property
    def dashboard_link(self) -> str | None:
        return self.cluster.dashboard_link if self.cluster and self.cfg.dashboard else None

    def __enter__(self) -> SlurmClassCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cfg, s = self.cfg, self.cfg.slurm
        options: dict[str, Any] = {"dashboard_address": ":0" if cfg.dashboard else None}
        if s.scheduler_host:
            options["host"] = s.scheduler_host
        self.cluster = SLURMCluster(name=self.pool_class, scheduler_options=options,
                                    **job_kwargs(cfg, self.pool_class))
        self.cluster.scheduler.add_plugin(KeepServiceWorkers(self.pool_class))
        self.cluster.sync(self._submit_fixed)
        self.cluster.scale(cfg.workers[self.pool_class])
        self.wait_for_workers()
        if s.adapt is not None:
            a = s.adapt
            self.cluster.adapt(Adaptive=ClassAdaptive, hw_class=self.pool_class,
                               minimum=a.minimum, maximum=a.maximum, interval=a.interval_s,
                               wait_count=a.wait_count, target_duration_s=a.target_duration_s)

    async def _submit_fixed(self) -> None:
        for hw_class, count in self.cfg.workers.items():
            if hw_class == self.pool_class:
                continue
            for i in range(count):
                name = f"{hw_class}-{i}"
                job = SLURMJob(scheduler=self.scheduler_address, name=name,
                               **job_kwargs(self.cfg, hw_class))
                try:
                    await job.start()  # sbatch; job.job_id from its output
                except RuntimeError as err:  # sbatch refused the script: say which class
                    why = str(err).split("stderr:", 1)[-1].strip() or str(err)
                    raise RuntimeError(
                        f"Slurm refused the {hw_class} worker job ({why}); check "
                        f"cluster.slurm.classes.{hw_class} (directives, gres, memory, "
                        "partition)") from None
                self.jobs[name] = job

    def job_ids(self) -> dict[str, str]:
        """Worker name -> Slurm job id, every class."""
        ids = {n: j.job_id for n, j in self.jobs.items()}
        if self.cluster is not None:
            ids.update({n: w.job_id for n, w in self.cluster.workers.items()
                        if getattr(w, "job_id", None)})
        return ids

    def class_counts(self) -> dict[str, int]:
        assert self.cluster is not None
        counts: dict[str, int] = {}
        for ws in list(self.cluster.scheduler.workers.values()):
            for res in ws.resources:
                counts[res] = counts.get(res, 0) + 1
        return counts

    def wait_for_workers(self) -> None:
        """Every class has its `workers` count joined, or RuntimeError naming what is missing
        and what Slurm says about its jobs (pending for lack of resources, failed, ...)."""
        deadline = time.monotonic() + self.cfg.slurm.join_timeout_s
        want = self.cfg.workers
        while time.monotonic() < deadline:
            have = self.class_counts()
            if all(have.get(c, 0) >= n for c, n in want.items()):
                return
            time.sleep(0.25)
        have = self.class_counts()
        missing = {c: n - have.get(c, 0) for c, n in want.items() if have.get(c, 0) < n}
        raise RuntimeError(
            f"Slurm workers did not join within {self.cfg.slurm.join_timeout_s:.0f} s; missing "
            f"{missing}; Slurm says: {self.squeue()}; see cluster.slurm.log_directory for the "
            "jobs' output")

    def squeue(self) -> str:
        ids = sorted(set(self.job_ids().values()))
        if not ids:
            return "no jobs submitted"
        out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %j %T %r"],
                             capture_output=True, text=True)
        return "; ".join(out.stdout.split("\n")).strip("; ") or out.stderr.strip() or "no jobs"

    def close(self) -> None:
        if self.cluster is None:
            return
        cluster, self.cluster = self.cluster, None
        try:
            if self.jobs:
                cluster.sync(self._cancel_fixed)
        finally:
            cluster.close()  # stops adapt, scancels the pool's jobs, ends the scheduler

    async def _cancel_fixed(self) -> None:
        jobs, self.jobs = self.jobs, {}
        await asyncio.gather(*(j.close() for j in jobs.values()), return_exceptions=True)
