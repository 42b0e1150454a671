"""Where stages run: the `cluster` section of the run config.

`cluster.manager` says who provides the Dask cluster:

    local        an embedded cluster on this machine, `workers` per class (the default)
    address      an existing scheduler at `address`, whose workers carry the class resources
    slurm        dask-jobqueue: one Slurm job per worker, job directives per class, the env
                 class adaptive between bounds (`slurm`, infra/slurm.py)
    kubernetes   the dask-kubernetes operator: one DaskCluster, one worker group per class with
                 node selectors / tolerations / GPU requests (`kubernetes`, infra/kubernetes.py)

Part of the `rollart.config` package (re-exported there). Same rules: unknown keys fail, and every
error says how to fix it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from rollart.config.base import _Strict
from rollart.config.hardware import default_stages, default_workers
from rollart.cpu_pinning import parse_cpu_list

Manager = Literal["local", "address", "slurm", "kubernetes"]

# Slurm/Kubernetes sizes and names, checked here so a typo fails at load, not minutes later in
# a queued job or a rejected manifest.
_MEM_SLURM = re.compile(r"\d+(\.\d+)?\s*([KMGT]i?B|[KMGT])?", re.IGNORECASE)
_WALLTIME = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}")
_K8S_QTY = re.compile(r"\d+(\.\d+)?(m|[KMGTPE]i?|[kMGTPE])?")
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class AdaptConfig(_Strict):
    """Adaptive scaling of one worker class (the env pool, CPU) between bounds. Workers that
    hold a service (an actor: env host, rollout service) are never retired."""

    hw_class: str = "CPU"
    """The class that scales: only the env class may (its workers hold no model)."""
    minimum: int = Field(1, ge=1)
    """the env hosts and the rollout service need one worker."""
    maximum: int = Field(4, ge=1)
    """Workers of the class at most."""
    target_duration_s: float = Field(5.0, gt=0.0)
    """Wanted workers = the class's queued work (scheduler occupancy) / target_duration_s."""
    interval_s: float = Field(1.0, gt=0.0)
    """how often to decide."""
    wait_count: int = Field(3, ge=1)
    """consecutive `fewer` decisions before a worker goes."""

    @model_validator(mode="after")
    def _bounds(self) -> AdaptConfig:
        if self.minimum > self.maximum:
            raise ValueError(f"adapt.minimum ({self.minimum}) must be <= adapt.maximum "
                             f"({self.maximum})")
        return self


class SlurmClassConfig(_Strict):
    """One hardware class's Slurm jobs (one worker per job)."""

    cores: int = Field(1, ge=1)
    """--cpus-per-task, and the worker's threads."""
    memory: str = "2GB"
    """--mem, and the worker's memory limit."""
    gres: str | None = None
    """e.g. "gpu:h800:1" -> #SBATCH --gres=gpu:h800:1."""
    partition: str | None = None
    """None: slurm.partition."""
    walltime: str | None = None
    """None: slurm.walltime."""
    directives: list[str] = []
    """more #SBATCH lines, e.g. ["--constraint=h800", `--exclusive`]."""

    @model_validator(mode="after")
    def _check(self) -> SlurmClassConfig:
        if not _MEM_SLURM.fullmatch(self.memory.strip()):
            raise ValueError(f"memory {self.memory!r} must look like 4GB or 500MB")
        if self.gres is not None and not re.fullmatch(r"[\w.-]+(:[\w.-]+)*(:\d+)?", self.gres):
            raise ValueError(f"gres {self.gres!r} must look like gpu:h800:1 (type:name:count)")
        if self.walltime is not None and not _WALLTIME.fullmatch(self.walltime):
            raise ValueError(f"walltime {self.walltime!r} must look like 04:00:00 or 1-00:00:00")
        for d in self.directives:
            if not d.startswith("-") or "\n" in d:
                raise ValueError(f"directive {d!r} must be one sbatch option such as "
                                 "--constraint=h800 (without #SBATCH)")
        return self


class SlurmConfig(_Strict):
    """`cluster.manager: slurm`: the run process starts the scheduler and submits one Slurm job
    per worker through dask-jobqueue; the workers must see this checkout at the same path and
    run `python` (the run's own interpreter by default)."""

    partition: str | None = None
    """-p; None: the cluster's default partition."""
    account: str | None = None
    """-A."""
    walltime: str = "04:00:00"
    """Job time limit (#SBATCH --time) of every worker job unless its class sets one."""
    python: str | None = None
    """None: the interpreter running the flow (same path on nodes)"""
    interface: str | None = None
    """network interface the scheduler and workers listen on."""
    scheduler_host: str | None = None
    """scheduler bind address; None: dask-jobqueue's default."""
    classes: dict[str, SlurmClassConfig] = {}
    """Per-class jobs; a class of `cluster.workers` not listed here gets SlurmClassConfig()."""
    adapt: AdaptConfig | None = AdaptConfig()
    """None: fixed `workers` counts."""
    join_timeout_s: float = Field(300.0, gt=0.0)
    """every worker joined, or the run fails."""
    log_directory: str | None = None
    """job stdout/stderr; None: Slurm's default (cwd)"""
    prologue: list[str] = []
    """shell lines before the worker starts (module load, venv, ...)"""

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if not _WALLTIME.fullmatch(self.walltime):
            raise ValueError(f"walltime {self.walltime!r} must look like 04:00:00")
        return self


class Toleration(_Strict):
    """A Kubernetes toleration (same fields, camelCase as in a pod spec)."""

    key: str | None = None
    """Taint key the toleration matches (None with operator Exists: every taint)."""
    operator: Literal["Equal", "Exists"] = "Equal"
    """`Equal`: the taint's value must equal `value`; `Exists`: any value."""
    value: str | None = None
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect the toleration matches; None: every effect."""


class KubernetesClassConfig(_Strict):
    """One hardware class's worker group: where its pods may go and what they request."""

    node_selector: dict[str, str] = {}
    """e.g. {nvidia.com/gpu.product: NVIDIA-H800}."""
    tolerations: list[Toleration] = []
    """Pod tolerations of the class's workers (e.g. for GPU node taints)."""
    gpus: int = Field(0, ge=0)
    """requests = limits of gpu_resource."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of the GPUs requested."""
    cpu: str = "1"
    """CPU request (= limit) of each worker pod, in Kubernetes quantity syntax."""
    memory: str = "4Gi"
    """Memory request (= limit) of each worker pod, in Kubernetes quantity syntax."""
    threads: int = Field(1, ge=1)
    """worker --nthreads."""

    @model_validator(mode="after")
    def _check(self) -> KubernetesClassConfig:
        for q, what in ((self.cpu, "cpu"), (self.memory, "memory")):
            if not _K8S_QTY.fullmatch(q):
                raise ValueError(f"{what} {q!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
        for k in self.node_selector:
            if not _LABEL_KEY.fullmatch(k):
                raise ValueError(f"node_selector key {k!r} is not a Kubernetes label key")
        if not _LABEL_KEY.fullmatch(self.gpu_resource):
            raise ValueError(f"gpu_resource {self.gpu_resource!r} is not a resource name "
                             "(e.g. nvidia.com/gpu)")
        return self


class KubernetesConfig(_Strict):
    """`cluster.manager: kubernetes`: a DaskCluster for the dask-kubernetes operator with one
    worker group per class (`rollart k8s render` writes the manifests)."""

    name: str = "rollart"
    """DaskCluster name (a DNS label)"""
    namespace: str = "default"
    """Namespace of the DaskCluster and its pods."""
    image: str = "rollart:latest"
    """An image with this project installed (and its venv); the scheduler imports it too."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of the scheduler and worker pods."""
    env: dict[str, str] = {}
    """on the scheduler and every worker."""
    scheduler_cpu: str = "1"
    """CPU request (= limit) of the scheduler pod."""
    scheduler_memory: str = "2Gi"
    """Memory request (= limit) of the scheduler pod."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Kubernetes Service type of the scheduler."""
    classes: dict[str, KubernetesClassConfig] = {}
    """missing classes: KubernetesClassConfig()"""
    adapt: AdaptConfig | None = AdaptConfig()
    """a DaskAutoscaler on the env class's group."""

    @model_validator(mode="after")
    def _check(self) -> KubernetesConfig:
        for v, what in ((self.name, "name"), (self.namespace, "namespace")):
            if len(v) > 40 or not _K8S_NAME.fullmatch(v):
                raise ValueError(f"{what} {v!r} must be a DNS label of at most 40 characters "
                                 "(lowercase letters, digits, '-')")
        for q in (self.scheduler_cpu, self.scheduler_memory):
            if not _K8S_QTY.fullmatch(q):
                raise ValueError(f"{q!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
        return self


class ClusterConfig(_Strict):
    """Where stages run (see the module docstring for `manager`)."""

    manager: Manager = "local"
    """None in the input: `address` when `address` is set, else `local` (older configs)."""
    address: str | None = None
    """manager `address`: tcp://host:8786."""
    workers: dict[str, int] = Field(default_factory=default_workers)
    """Worker count per hardware class (local, slurm, kubernetes); each worker gets resource {class:
    1}. Under an adaptive class this is the count it starts with."""
    stages: dict[str, str] = Field(default_factory=default_stages)
    """Stage -> hardware class (= Dask resource name)."""
    threads_per_worker: int = Field(1, gt=0)
    """Threads of each Dask worker of the embedded cluster."""
    dashboard: bool = True
    """Start the Dask dashboard of the embedded cluster (its address is printed in the log)."""
    tls: bool = True
    """Local cluster: TLS with mutual authentication on every Dask connection (a fresh CA per run;
    infra/dask_tls.py). false only to measure what it costs (benchmarks/security_overhead)."""
    call_timeout_s: float = Field(600.0, gt=0.0)
    """Deadline of every call to a service on another worker (actor call: update, sync, checkpoint,
    generate, env step, ...): past it the call raises CallTimeoutError naming the service and method
    instead of hanging the run. Generous: a policy update of a large model is one such call. Waiting
    for a batch (`take_batch`) has no deadline. The trainer's update, save and load are slow, not
    lost, while their worker still sends heartbeats: they go on past this, up to 4x it
    (rollart.handles `while_alive`, BUSY_FACTOR)."""
    max_restarts: int = Field(2, ge=0)
    """A lost trainer or rollout service (its worker died or hung past call_timeout_s): the run
    re-creates its services and resumes from the latest complete checkpoint, in the same flow run,
    at most this many times (rollart/runner/recovery.py); 0: the run fails instead."""
    task_runner: Literal["threads", "dask"] = "threads"
    """How the flow runs its stage tasks (both keep every stage on a worker of its class):
    `threads`: Prefect tasks on a thread pool in the flow process, each submitting its stage as a
    raw Dask task annotated with the class (~ms of Prefect overhead per task); `dask`: Prefect's
    DaskTaskRunner ships each task to the worker (~0.2-0.3 s per task)."""
    engine_pools: dict[str, int] | None = None
    """Engine replicas per hardware class, e.g. {H800: 1, H20: 1} (prefill- and decode-heavy pools;
    see `routing`). None: `engine.replicas` replicas on `stages.engine` (one pool)."""
    cpu_cores: dict[str, str] | None = None
    """Local manager: CPU cores per hardware class, Linux cpu-list syntax, e.g. {H800: `1`, H20:
    `0`}: each class's workers run on their own cores (rollart/cpu_pinning.py). None: every worker
    may use every core."""
    slurm: SlurmConfig = SlurmConfig()
    """Settings of manager `slurm` (dask-jobqueue, one job per worker)."""
    kubernetes: KubernetesConfig = KubernetesConfig()
    """Settings of manager `kubernetes` (the dask-kubernetes operator)."""

    @model_validator(mode="before")
    @classmethod
    def _infer_manager(cls, data: Any) -> Any:
        # Configs written before `manager` existed said only `address`: keep their meaning.
        if isinstance(data, dict) and data.get("manager") is None:
            data = {**data, "manager": "address" if data.get("address") else "local"}
        return data

    def _check_cpu_cores(self) -> None:
        if not self.cpu_cores:
            return
        if self.manager != "local":
            raise ValueError("cluster.cpu_cores pins the workers of the local manager; with "
                             f"manager {self.manager!r} give cores per class in its own section "
                             "(e.g. slurm.classes.H800.cores)")
        for cls_name, spec in self.cpu_cores.items():
            if cls_name not in self.workers:
                raise ValueError(f"cluster.cpu_cores names class {cls_name!r}, which has no "
                                 f"workers (classes: {sorted(self.workers)})")
            try:
                parse_cpu_list(spec)
            except ValueError as err:
                raise ValueError(f"cluster.cpu_cores.{cls_name}: {err}") from None

    def engine_classes(self, replicas: int = 1) -> list[str]:
        """Hardware class of each engine replica, in replica order."""
        if self.engine_pools is None:
            return [self.stages["engine"]] * replicas
        return [c for c, n in self.engine_pools.items() for _ in range(n)]

    @model_validator(mode="after")
    def _stages(self) -> ClusterConfig:
        need = {"trainer", "engine", "env", "reward"}
        missing = need - set(self.stages)
        if missing:
            raise ValueError(f"cluster.stages is missing {sorted(missing)}")
        if self.engine_pools is not None:
            if not self.engine_pools or any(n < 1 for n in self.engine_pools.values()):
                raise ValueError(
                    "cluster.engine_pools must map each class to >= 1 replicas, e.g. "
                    "{H800: 1, H20: 1} (or null for one pool on stages.engine)"
                )
        self._check_manager()
        self._check_cpu_cores()
        if self.manager == "address":
            return self  # the scheduler's workers are checked when the run connects
        if any(n < 1 for n in self.workers.values()):
            raise ValueError("cluster.workers must give each class >= 1 workers")
        unknown = {c for c in self.stages.values() if c not in self.workers}
        if unknown:
            raise ValueError(
                f"cluster.stages maps to classes {sorted(unknown)} that have no workers in "
                "cluster.workers"
            )
        unknown = {c for c in self.engine_pools or {} if c not in self.workers}
        if unknown:
            raise ValueError(
                f"cluster.engine_pools names classes {sorted(unknown)} that have no workers "
                "in cluster.workers (add them there, e.g. workers: {H800: 1, H20: 1, CPU: 1})"
            )
        if self.manager in ("slurm", "kubernetes"):
            self._check_classes(self.manager)
        return self

    def _check_manager(self) -> None:
        if self.manager == "address" and not self.address:
            raise ValueError("cluster.manager 'address' needs cluster.address (tcp://host:8786)"
                             "; or use manager: local for an embedded cluster")
        if self.address and self.manager != "address":
            raise ValueError(
                f"cluster.address is set but cluster.manager is {self.manager!r}, which starts "
                "its own scheduler: drop address, or set manager: address")
        if self.address and not re.match(r"^(tcp|tls|ucx|inproc)://\S+$", self.address):
            raise ValueError(f"cluster.address {self.address!r} must look like "
                             "tcp://host:8786")

    def _check_classes(self, manager: str) -> None:
        section: SlurmConfig | KubernetesConfig = getattr(self, manager)
        unknown = sorted(set(section.classes) - set(self.workers))
        if unknown:
            raise ValueError(
                f"cluster.{manager}.classes names {unknown}, which cluster.workers does not "
                f"start (classes there: {sorted(self.workers)})")
        adapt = section.adapt
        if adapt is None:
            return
        if adapt.hw_class != self.stages["env"]:
            raise ValueError(
                f"cluster.{manager}.adapt.hw_class is {adapt.hw_class!r}, but only the env "
                f"class ({self.stages['env']!r}) scales: its workers hold no model")
        start = self.workers[adapt.hw_class]
        if not adapt.minimum <= start <= adapt.maximum:
            raise ValueError(
                f"cluster.workers.{adapt.hw_class} ({start}) must lie within "
                f"cluster.{manager}.adapt bounds [{adapt.minimum}, {adapt.maximum}]")

    def class_settings(self, hw_class: str) -> Any:
        """The Slurm or Kubernetes settings of `hw_class` (defaults when not listed)."""
        if self.manager == "slurm":
            return self.slurm.classes.get(hw_class, SlurmClassConfig())
        if self.manager == "kubernetes":
            return self.kubernetes.classes.get(hw_class, KubernetesClassConfig())
        raise ValueError(f"cluster.manager {self.manager!r} has no per-class settings")
