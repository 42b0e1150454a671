"""Pure parts of the control plane: block -> config overrides (valid, secret-free), the chart
artifact, artifact keys, `rollart submit` parameter parsing, prefect.yaml's shape."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from blocks import DaskCluster, LambdaRewards, ModelSource, RunStorage
from flows.artifacts import artifact_key, checkpoints_markdown, curve_markdown, curve_svg
from rollart.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_block_overrides_make_a_valid_config_without_secrets():
    storage = RunStorage(bucket="rollart", endpoint_url="http://127.0.0.1:9000",
                         access_key_id="AKIDEXAMPLE", secret_access_key="s3cr3t-value")
    blocks = [storage, LambdaRewards(endpoint_url="http://127.0.0.1:9001", max_concurrency=4),
              DaskCluster(scheduler_address="tcp://127.0.0.1:8786"),
              ModelSource(tiny={"hidden_size": 64})]
    overrides = [o for b in blocks for o in b.config_overrides()]
    cfg = load_config(ROOT / "configs/default.yaml", overrides)
    assert cfg.storage.root == "s3://rollart"
    assert cfg.storage.endpoint_url == "http://127.0.0.1:9000"
    assert cfg.reward.endpoint_url == "http://127.0.0.1:9001" and not cfg.reward.embedded_endpoint
    assert cfg.cluster.address == "tcp://127.0.0.1:8786"
    assert "s3cr3t-value" not in json.dumps(overrides)
    assert storage.environment()["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(storage) and "s3cr3t-value" not in str(storage)


def test_embedded_lambda_and_local_storage_blocks():
    cfg = load_config(ROOT / "configs/default.yaml",
                      LambdaRewards(embedded_endpoint=True).config_overrides()
                      + RunStorage(root="/tmp/x").config_overrides())
    assert cfg.reward.embedded_endpoint and cfg.reward.endpoint_url is None
    assert cfg.storage.root == "/tmp/x" and RunStorage(root="/tmp/x").environment() == {}


def test_curve_chart_is_an_inline_svg_image():
    history = [{"version": float(i + 1), "reward/mean": -0.5 + 0.1 * i,
                "rollout/success_rate": 0.1 * i, **({"eval/success_rate": 0.5} if i == 3 else {})}
               for i in range(4)]
    svg = curve_svg(history, "run <1>")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<circle") == 4 + 4 + 1 and "run &lt;1&gt;" in svg
    md = curve_markdown("r", history)
    data = md.split("data:image/svg+xml;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(data).decode() == curve_svg(history, "r: reward and success")
    assert curve_svg([], "empty").startswith("<svg")  # before the first iteration


def test_artifact_keys_and_checkpoint_links():
    assert artifact_key("FrozenLake_tiny.2026", "metrics") == "frozenlake-tiny-2026-metrics"
    md = checkpoints_markdown("r", "s3://b/runs/r", [{"step": 2, "path": "s3://b/runs/r/c/2",
                                                      "bytes": 2e6}], endpoint_url=None)
    assert "https://s3.console.aws.amazon.com/s3/buckets/b?prefix=runs/r/c/2/" in md
    local = checkpoints_markdown("r", "/tmp/runs/r", [{"step": 2, "path": "/tmp/runs/r/c/2"}])
    assert "`/tmp/runs/r/c/2`" in local


def test_submit_params_parse_json_and_sets():
    import typer

    from cli.stack import _parse_params

    p = _parse_params(["run_id=abc", "episodes=4", 'overrides=["iterations=2"]'], ["seed=3"])
    assert p == {"run_id": "abc", "episodes": 4, "overrides": ["iterations=2", "seed=3"]}
    with pytest.raises(typer.Exit):
        _parse_params(["no-equals"], [])


def test_prefect_yaml_deployments_share_one_pool():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"train", "evaluate", "continue-nightly", "train-k8s"}
    # The local stack's deployments share its process pool; train-k8s runs on the Kubernetes
    # pool (tests/unit/test_kubernetes.py checks its job template).
    assert {d["work_pool"]["name"] for n, d in deps.items() if n != "train-k8s"} == {
        "rollart-local"}
    assert deps["train-k8s"]["work_pool"]["name"] == "rollart-k8s"
    assert deps["continue-nightly"]["schedules"][0]["cron"] == "0 3 * * *"
    assert deps["train"]["parameters"]["config"] == "configs/default.yaml"
    for d in deps.values():  # module entrypoints: Dask workers can import what is pickled
        module, _, fn = d["entrypoint"].partition(":")
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() and fn
