"""`cluster.manager: kubernetes`, rendered and checked without a cluster: the DaskCluster with one
worker group per class (against the operator's CRDs), and the Prefect Kubernetes work pool's job
template in prefect.yaml (through prefect-kubernetes' own job configuration, into a batch/v1 Job
checked against the Kubernetes API models)."""

from __future__ import annotations

import asyncio
import copy
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from infra.k8s_check import ManifestError, check_crd_object, check_model
from infra.kubernetes import cluster_manifests, group_name, job_template, render
from rollart.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _k8s_deployment() -> dict:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return next(d for d in spec["deployments"] if d["name"] == "train-k8s")


def _cfg(*extra: str):
    params = _k8s_deployment()["parameters"]
    return load_config(ROOT / params["config"], list(params["overrides"]) + list(extra))


def _container(obj: dict) -> dict:
    (c,) = obj["spec"]["worker"]["spec"]["containers"]
    return c


def test_one_worker_group_per_class_with_placement_and_gpus():
    cfg = _cfg("cluster.workers={H800: 1, H20: 2, CPU: 3}")
    objs = cluster_manifests(cfg.cluster)
    for obj in objs:
        check_crd_object(obj)  # what the API server with the operator's CRDs accepts
        check_model(obj["metadata"], "V1ObjectMeta")
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert kinds == [("DaskCluster", "rollart"), ("DaskWorkerGroup", "rollart-h800"),
                     ("DaskWorkerGroup", "rollart-h20"), ("DaskAutoscaler", "rollart")]
    cluster, h800, h20, scaler = objs
    # The env class is the cluster's default group: the one the DaskAutoscaler scales.
    args = _container(cluster)["args"]
    assert args[args.index("--resources") + 1] == "CPU=1"
    assert cluster["spec"]["worker"]["replicas"] == 3
    assert scaler["spec"] == {"cluster": "rollart", "minimum": 1, "maximum": 4}
    for obj, hw, product, n in ((h800, "H800", "NVIDIA-H800", 1), (h20, "H20", "NVIDIA-H20", 2)):
        pod, c = obj["spec"]["worker"]["spec"], _container(obj)
        assert obj["spec"]["cluster"] == "rollart"
        assert obj["metadata"]["name"] == group_name(cfg.cluster, hw)
        assert obj["spec"]["worker"]["replicas"] == n
        assert c["args"][c["args"].index("--resources") + 1] == f"{hw}=1"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                       "effect": "NoSchedule"}]
        # Extended resources: requests must equal limits (Kubernetes refuses otherwise).
        assert c["resources"]["requests"] == c["resources"]["limits"] == {
            "cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}
        check_model(pod, "V1PodSpec")
    assert "nvidia.com/gpu" not in _container(cluster)["resources"]["limits"]  # CPU pool
    (sched,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    # The scheduler preloads the rule that scale-down never takes a worker holding a service.
    assert sched["args"][-2:] == ["--preload", "infra.scaling"]
    assert {"name": "ROLLART_ADAPT_CLASS", "value": "CPU"} in sched["env"]
    check_model(cluster["spec"]["scheduler"]["service"], "V1ServiceSpec")


def test_adapt_off_renders_no_autoscaler():
    objs = cluster_manifests(_cfg("cluster.kubernetes.adapt=null").cluster)
    assert [o["kind"] for o in objs].count("DaskAutoscaler") == 0


@pytest.mark.parametrize("mutate, fragment", [
    (lambda o: o["spec"]["worker"]["spec"].update(nodeselector={"a": "b"}),
     "unknown field(s) ['DaskWorkerGroup.spec.worker.spec.nodeselector']"),
    (lambda o: _container(o)["resources"]["limits"].update({"nvidia.com/gpu": 1}),
     "is not of type 'string'"),
    (lambda o: _container(o).pop("name"), "'name' is a required property"),
    (lambda o: o["spec"].pop("cluster"), "'cluster' is a required property"),
    (lambda o: o["metadata"].update(lables={}), "unknown field(s) ['lables']"),
])
def test_the_check_refuses_what_kubernetes_would(mutate, fragment):
    obj = copy.deepcopy(cluster_manifests(_cfg().cluster)[1])
    mutate(obj)
    with pytest.raises(ManifestError) as err:
        check_crd_object(obj)
    assert fragment in str(err.value)


def test_core_model_check_catches_types_and_unknown_fields():
    pod = copy.deepcopy(cluster_manifests(_cfg().cluster)[1]["spec"]["worker"]["spec"])
    check_model(pod, "V1PodSpec")
    pod["containers"][0]["imagePullPolicy"] = ["Always"]
    with pytest.raises(ManifestError, match=r"containers\[0\]\.imagePullPolicy: must be str"):
        check_model(pod, "V1PodSpec")
    with pytest.raises(ManifestError, match="unknown field"):
        check_model({"containers": [], "restart_policy": "Never"}, "V1PodSpec")


def test_prefect_work_pool_job_template_renders_a_valid_job():
    import jsonschema
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = job_template(ROOT / "prefect.yaml")
    job_vars = _k8s_deployment()["work_pool"]["job_variables"]
    jsonschema.validate(job_vars, template["variables"])  # what the server checks at deploy
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**job_vars, "image_pull_policy": "Sometimes"}, template["variables"])

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
        template, job_vars, client=SimpleNamespace()))
    flow_run = FlowRun(id=uuid.uuid4(), name="calm-otter", flow_id=uuid.uuid4())
    config.prepare_for_flow_run(flow_run)  # what the worker does before creating the Job
    job = copy.deepcopy(config.job_manifest)
    pod = job["spec"]["template"]["spec"]
    # prefect-kubernetes demands these two in the pod spec (see prefect.yaml); the API server
    # drops them there. Everything else must be a field of batch/v1 Job.
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    check_model(job, "V1Job")
    (c,) = pod["containers"]
    assert c["image"] == "rollart:latest" and pod["serviceAccountName"] == "rollart"
    assert job["metadata"]["namespace"] == "default"
    assert c["args"][:3] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMP_NUM_THREADS"] == "1" and env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}


def test_k8s_deployment_config_and_render_writes_checked_files(tmp_path):
    cfg = _cfg()
    assert cfg.cluster.manager == "kubernetes" and cfg.storage.root.startswith("s3://")
    files = render(cfg.cluster, ROOT / "prefect.yaml")
    docs = list(yaml.safe_load_all(files["dask-cluster.yaml"]))
    assert [d["kind"] for d in docs][:1] == ["DaskCluster"] and len(docs) == 4
    import json

    assert json.loads(files["prefect-job-template.json"]) == job_template(ROOT / "prefect.yaml")


def test_scale_down_rule_keeps_service_workers():
    from infra.scaling import KeepServiceWorkers, may_retire

    def ws(res, actors=(), processing=()):
        return SimpleNamespace(resources={res: 1}, actors=set(actors), processing=set(processing))

    idle_env, actor_env = ws("CPU"), ws("CPU", actors=["env-host"])
    busy_env, gpu = ws("CPU", processing=["collect"]), ws("H800")
    assert may_retire(idle_env, "CPU")
    assert not any(may_retire(w, "CPU") for w in (actor_env, busy_env, gpu))
    plugin = KeepServiceWorkers("CPU")
    assert plugin.valid_workers_downscaling(None, [idle_env, actor_env, busy_env, gpu]) == [
        idle_env]
