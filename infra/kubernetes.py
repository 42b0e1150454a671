"""`cluster.manager: kubernetes`: the run's Dask cluster through the dask-kubernetes operator.

Manifests (`cluster_manifests`, written by `rollart k8s render`):

    DaskCluster        scheduler (preloads infra.scaling: scale-down never takes a worker
                       holding a service) + the `default` worker group = the env class (CPU)
    DaskWorkerGroup    one per other class, `{name}-{class}`: its node selector, tolerations,
                       GPU request (requests = limits, as Kubernetes wants for extended
                       resources), workers started with `--resources CLASS=1`
    DaskAutoscaler     `cluster.kubernetes.adapt` bounds on the default (env) group

`KubeClassCluster` creates the same objects through the operator's KubeCluster at run start and
deletes them at the end. Only the rendering is tested here (no Kubernetes on these machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from infra.dask_cluster import WORKER_ENVIRON
from rollart.config.cluster import ClusterConfig, KubernetesClassConfig

API = "kubernetes.dask.org/v1"


def _env(cfg: ClusterConfig, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
    base = {k: str(v) for k, v in WORKER_ENVIRON.items() if v is not None}
    merged = {**base, **cfg.kubernetes.env, **(extra or {})}
    return [{"name": k, "value": v} for k, v in sorted(merged.items())]


def group_name(cfg: ClusterConfig, hw_class: str) -> str:
    """The DaskWorkerGroup of a class (lowercase: Kubernetes names are DNS labels)."""
    return f"{cfg.kubernetes.name}-{hw_class.lower()}"


def worker_spec(cfg: ClusterConfig, hw_class: str) -> dict[str, Any]:
    """The `worker` of a DaskCluster/DaskWorkerGroup: replicas + a pod spec for `hw_class`."""
    k, c = cfg.kubernetes, cfg.class_settings(hw_class)
    assert isinstance(c, KubernetesClassConfig)
    res: dict[str, Any] = {"cpu": c.cpu, "memory": c.memory}
    if c.gpus:
        res[c.gpu_resource] = str(c.gpus)
    pod: dict[str, Any] = {
        "containers": [{
            "name": "worker",
            "image": k.image,
            "imagePullPolicy": k.image_pull_policy,
            # The operator sets DASK_SCHEDULER_ADDRESS and DASK_WORKER_NAME in the pod.
            "args": ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--nthreads",
                     str(c.threads), "--resources", f"{hw_class}=1", "--memory-limit", "0",
                     "--dashboard", "--dashboard-address", "8788"],
            "env": _env(cfg),
            "resources": {"requests": dict(res), "limits": dict(res)},
            "ports": [{"name": "http-dashboard", "containerPort": 8788, "protocol": "TCP"}],
        }],
    }
    if c.node_selector:
        pod["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in c.tolerations]
    return {"replicas": cfg.workers[hw_class], "spec": pod}


def scheduler_spec(cfg: ClusterConfig) -> dict[str, Any]:
    k = cfg.kubernetes
    res = {"cpu": k.scheduler_cpu, "memory": k.scheduler_memory}
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    return {
        "spec": {"containers": [{
            "name": "scheduler",
            "image": k.image,
            "imagePullPolicy": k.image_pull_policy,
            "args": ["dask", "scheduler", "--host", "0.0.0.0", "--preload", "infra.scaling"],
            "env": _env(cfg, {"ROLLART_ADAPT_CLASS": cfg.stages["env"]}),
            "resources": {"requests": dict(res), "limits": dict(res)},
            "ports": [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                      {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"}],
            "readinessProbe": {**probe, "initialDelaySeconds": 0, "periodSeconds": 1,
                               "timeoutSeconds": 300},
            "livenessProbe": {**probe, "initialDelaySeconds": 15, "periodSeconds": 20},
        }]},
        "service": {
            "type": k.service_type,
            "selector": {"dask.org/cluster-name": k.name, "dask.org/component": "scheduler"},
            "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": 8786,
                       "targetPort": "tcp-comm"},
                      {"name": "http-dashboard", "protocol": "TCP", "port": 8787,
                       "targetPort": "http-dashboard"}],
        },
    }


def cluster_manifests(cfg: ClusterConfig) -> list[dict[str, Any]]:
    """Every object the run's cluster consists of, in the order to apply them."""
    k, env_class = cfg.kubernetes, cfg.stages["env"]
    meta = {"namespace": k.namespace, "labels": {"app.kubernetes.io/part-of": "rollart"}}
    out: list[dict[str, Any]] = [{
        "apiVersion": API, "kind": "DaskCluster",
        "metadata": {"name": k.name, **meta},
        "spec": {"worker": worker_spec(cfg, env_class), "scheduler": scheduler_spec(cfg)},
    }]
    for hw_class in cfg.workers:
        if hw_class != env_class:
            out.append({
                "apiVersion": API, "kind": "DaskWorkerGroup",
                "metadata": {"name": group_name(cfg, hw_class), **meta},
                "spec": {"cluster": k.name, "worker": worker_spec(cfg, hw_class)},
            })
    if k.adapt is not None:
        out.append({
            "apiVersion": API, "kind": "DaskAutoscaler",
            "metadata": {"name": k.name, **meta},
            "spec": {"cluster": k.name, "minimum": k.adapt.minimum, "maximum": k.adapt.maximum},
        })
    return out


class KubeClassCluster:
    """Context manager: the DaskCluster and its class worker groups via the operator (needs a
    cluster with the operator installed and a kubeconfig); deleted on exit."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.cluster: Any = None

    def __enter__(self) -> KubeClassCluster:
        from dask_kubernetes.operator import KubeCluster

        objs = cluster_manifests(self.cfg)
        self.cluster = KubeCluster(custom_cluster_spec=objs[0],
                                   namespace=self.cfg.kubernetes.namespace,
                                   shutdown_on_close=True)
        try:
            for obj in objs[1:]:
                if obj["kind"] == "DaskWorkerGroup":
                    name = obj["metadata"]["name"].removeprefix(f"{self.cfg.kubernetes.name}-")
                    self.cluster.add_worker_group(name, custom_spec=obj["spec"]["worker"])
            if self.cfg.kubernetes.adapt is not None:
                a = self.cfg.kubernetes.adapt
                self.cluster.adapt(minimum=a.minimum, maximum=a.maximum)
        except BaseException:
            self.cluster.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.close()

    @property
    def scheduler_address(self) -> str:
        return self.cluster.scheduler_address

    @property
    def dashboard_link(self) -> str | None:
        return self.cluster.dashboard_link


def job_template(prefect_file: str | Path) -> dict[str, Any]:
    """The `rollart-k8s` work pool's base job template, from prefect.yaml's definitions."""
    spec = yaml.safe_load(Path(prefect_file).read_text())
    return spec["definitions"]["kubernetes_job_template"]


def render(cfg: ClusterConfig, prefect_file: str | Path) -> dict[str, str]:
    """File name -> text: the DaskCluster objects (multi-document YAML) and the work pool's job
    template (JSON, what `prefect work-pool create --base-job-template` takes), each checked
    first (infra/k8s_check.py) so a broken manifest is never written."""
    from infra.k8s_check import check_crd_object

    objs = cluster_manifests(cfg)
    for obj in objs:
        check_crd_object(obj)
    return {"dask-cluster.yaml": yaml.safe_dump_all(objs, sort_keys=False),
            "prefect-job-template.json": json.dumps(job_template(prefect_file), indent=2)}
