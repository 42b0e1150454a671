"""The Kubernetes work pool and the `train-k8s` deployment, accepted by a real Prefect server:
the pool is created from the job template `rollart k8s render` writes (prefect.yaml's), and the
server checks the deployment's job variables against it (no Kubernetes needed for that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_k8s_pool_and_deployment_are_accepted(prefect_api, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import PrefectHTTPStatusError

    from infra.kubernetes import render
    from rollart.config import load_config

    files = render(load_config(ROOT / "configs/default.yaml", ["cluster.manager=kubernetes"])
                   .cluster, ROOT / "prefect.yaml")
    template = json.loads(files["prefect-job-template.json"])
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="rollart-k8s", type="kubernetes",
                                               base_job_template=template))
    # The real `prefect deploy` of prefect.yaml's train-k8s onto that pool.
    dep = subprocess.run(
        [str(Path(sys.executable).with_name("prefect")), "deploy", "--no-prompt", "--name",
         "train-k8s"], cwd=ROOT, env={**os.environ, "PREFECT_API_URL": prefect_api},
        capture_output=True, text=True, timeout=300)
    assert dep.returncode == 0, dep.stdout[-2000:] + dep.stderr[-2000:]
    with get_client(sync_client=True) as client:
        d = client.read_deployment_by_name("train/train-k8s")
        assert d.work_pool_name == "rollart-k8s"
        assert d.job_variables["service_account_name"] == "rollart"
        assert "cluster.manager=kubernetes" in d.parameters["overrides"]
        # A deployment whose job variables the template does not allow is refused.
        with pytest.raises(PrefectHTTPStatusError, match="Sometimes"):
            client.create_deployment(
                flow_id=d.flow_id, name="train-k8s-bad", work_pool_name="rollart-k8s",
                entrypoint=d.entrypoint,
                job_variables={**d.job_variables, "image_pull_policy": "Sometimes"})
