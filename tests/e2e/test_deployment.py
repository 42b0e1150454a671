"""End to end through the control plane: stack up -> deploy -> `prefect deployment run` -> the
process worker runs a short training run on the stack's Dask workers -> Completed with its
artifacts; evaluate and the scheduled continue deployment; `rollart submit` exit codes."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pytest

pytestmark = pytest.mark.e2e


def _artifacts(stack, flow_run_id) -> dict[str, object]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with stack.client() as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    latest: dict[str, object] = {}
    for a in sorted(arts, key=lambda a: a.created):
        latest[a.key] = a
    return latest


def _logs(stack) -> str:
    """Every log line the server holds (all runs)."""
    out: list[str] = []
    with stack.client() as c:
        while batch := c.read_logs(limit=200, offset=len(out)):
            out += [r.message for r in batch]
    return "\n".join(out)


def test_stack_up_is_healthy_and_idempotent(stack):
    services = {s["name"]: s for s in stack.info["services"]}
    expected = {"prefect-server", "prefect-worker", "dask-scheduler", "dask-H800-0",
                "dask-H20-0", "dask-CPU-0", "lambda"}
    assert expected <= set(services), services
    assert all(s["up"] for s in services.values()), services
    for s in services.values():  # loopback only
        assert s["url"] is None or "127.0.0.1" in s["url"], s
    for hw in ("H800", "H20", "CPU"):
        assert services[f"dask-{hw}-0"]["extra"]["resources"] == {hw: 1.0}
    # The human-readable status names each URL: Prefect UI and the Dask dashboard, and how
    # each service authenticates; the API refuses a call without the stack's credentials.
    human = stack.cli("status").stdout
    assert stack.ui_url in human and stack.info["dashboard_url"] in human
    for name in ("prefect-server", "dask-scheduler", "lambda"):
        assert services[name]["extra"].get("auth"), services[name]
        assert f"auth {services[name]['extra']['auth']}" in human
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(
            f"{stack.api_url}/flow_runs/filter", data=b"{}", method="POST",
            headers={"Content-Type": "application/json"}), timeout=10)
    assert err.value.code == 401
    with urllib.request.urlopen(stack.info["dashboard_url"], timeout=10) as r:
        assert r.status == 200
    # The UI is told where its own API is (not the default port 4200).
    with urllib.request.urlopen(f"{stack.ui_url}/ui-settings", timeout=10) as r:
        assert json.loads(r.read())["api_url"] == stack.api_url

    # Dask workers of the stack keep the memory they free (infra/dask_cluster.py WORKER_ENVIRON,
    # not the nanny's MALLOC_TRIM_THRESHOLD_=65536). The scheduler
    # speaks TLS and wants the stack's certificate (tests/security/test_dask_tls.py).
    import contextlib

    from distributed import Client

    from infra.dask_tls import connect_existing

    assert stack.info["scheduler_address"].startswith("tls://")
    with contextlib.ExitStack() as es:
        assert connect_existing(es, stack.info["scheduler_address"], stack.state)
        c = es.enter_context(Client(stack.info["scheduler_address"], timeout=20))
        env = c.run(lambda: [__import__("os").environ.get(k, "unset")
                             for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")])
        # no worker has a key in its environment: a run hands each class what it uses
        # (rollart/secrets.py, tests/security/test_secret_scope.py)
        keys = c.run(lambda: sorted(k for k in __import__("os").environ
                                    if k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION",
                                                     "ROLLART_LAMBDA_"))))
    assert all(v == [str(1 << 40), "1"] for v in env.values()), env
    assert all(v == [] for v in keys.values()), keys

    # A second `up` reuses every running service.
    before = {s["name"]: s["pid"] for s in stack.info["services"]}
    t0 = time.monotonic()
    stack.cli("up", "--poll-seconds", "2")
    again = json.loads(stack.cli("status", "--json").stdout)
    assert {s["name"]: s["pid"] for s in again["services"]} == before
    assert time.monotonic() - t0 < 30


def test_blocks_registered_with_secrets_masked(stack):
    assert "deployment train/train" in stack.deploy_output
    with stack.client() as c:
        for slug in ("rollart-storage", "rollart-lambda-rewards", "rollart-dask-cluster",
                     "rollart-model-source"):
            assert c.read_block_type_by_slug(slug).slug == slug
        doc = c.read_block_document_by_name("local", "rollart-storage", include_secrets=False)
        cluster = c.read_block_document_by_name("local", "rollart-dask-cluster")
    assert cluster.data["scheduler_address"] == stack.info["scheduler_address"]
    secret = stack.secret()
    if secret:  # the stack's S3 is the store: its credentials are secret fields
        assert doc.data["bucket"] and doc.data["secret_access_key"] != secret
        assert secret not in json.dumps(doc.data, default=str)
        assert secret not in stack.deploy_output + stack.up_output


def test_deployment_run_completes_with_artifacts(stack):
    out = stack.prefect("deployment", "run", "train/train", "--param", "run_id=e2e-cli")
    assert out.returncode == 0, out.stdout + out.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    fr = stack.wait_final(flow_run_id, timeout=360)
    assert fr.state.type.value == "COMPLETED", fr.state
    assert fr.work_pool_name == "rollart-local"

    arts = _artifacts(stack, flow_run_id)
    assert {"e2e-cli-progress", "e2e-cli-metrics", "e2e-cli-curves",
            "e2e-cli-checkpoints"} <= set(arts), sorted(arts)
    assert float(arts["e2e-cli-progress"].data) == pytest.approx(100.0)
    rows = json.loads(arts["e2e-cli-metrics"].data)
    assert [r["iter"] for r in rows] == [0, 1]
    curves = arts["e2e-cli-curves"].data
    m = re.search(r"\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", curves)
    assert m, curves[:300]
    svg = base64.b64decode(m.group(1)).decode()
    assert svg.startswith("<svg") and svg.count("<circle") >= 4  # reward + success points
    assert "00000002" in arts["e2e-cli-checkpoints"].data

    # Training ran as stage tasks (on the stack's Dask workers), all completed.
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with stack.client() as c:
        subs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [s.id for s in subs]}))
    names = {t.name.rsplit("-", 1)[0] for t in tasks}
    assert {"prepare", "collect", "score", "update", "sync_weights", "checkpoint"} <= names
    assert all(t.state.type.value == "COMPLETED" for t in tasks)

    secret = stack.secret()
    if secret:
        assert secret not in _logs(stack)


def test_evaluate_deployment_on_the_checkpoint(stack):
    proc = stack.cli("submit", "--deployment", "evaluate", "--param", "run_id=e2e-cli",
                     "--param", "episodes=4", "--wait", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fid = re.search(r"/runs/flow-run/([0-9a-f-]{36})", proc.stdout).group(1)
    arts = _artifacts(stack, fid)
    assert {"e2e-cli-eval", "e2e-cli-eval-2"} <= set(arts)
    rows = {r["metric"]: r["value"] for r in json.loads(arts["e2e-cli-eval-2"].data)}
    assert rows["eval/episodes"] == 4 and rows["eval/weight_version"] == 2
    assert 0.0 <= rows["eval/success_rate"] <= 1.0


def test_scheduled_deployment_lists_upcoming_runs(stack):
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    with stack.client() as c:
        dep = c.read_deployment_by_name("continue-training/continue-nightly")
        assert [s.schedule.cron for s in dep.schedules] == ["0 3 * * *"]
        deadline, runs = time.monotonic() + 60, []
        while time.monotonic() < deadline:  # the server's scheduler fills them in
            runs = c.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(
                    any_=["continue-nightly"])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=["SCHEDULED"]))))
            if len(runs) >= 3:
                break
            time.sleep(1)
    assert len(runs) >= 3, runs
    times = sorted(r.expected_start_time for r in runs)
    now = datetime.now(timezone.utc)
    assert all(t > now for t in times)
    assert all((t.astimezone(timezone.utc).hour, t.minute) == (3, 0) for t in times)
    assert len({t.date() for t in times}) == len(times)  # one a night


def test_submit_exit_codes_and_scheduled_continue(stack):
    good = stack.cli("submit", "--deployment", "train", "--param", "run_id=e2e-submit",
                     "--wait", check=False)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"{stack.ui_url}/runs/flow-run/" in good.stdout
    states = re.findall(r"^\d\d:\d\d:\d\d (\w+)", good.stdout, re.M)
    assert states[-1] == "Completed" and "Running" in states, good.stdout

    bad = stack.cli("submit", "--deployment", "train", "--set", "train.lrr=1", "--wait",
                    check=False)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"{stack.ui_url}/runs/flow-run/" in bad.stdout
    assert "Failed" in bad.stdout and "unknown config key 'train.lrr'" in bad.stdout

    missing = stack.cli("submit", "--deployment", "no-such-thing", check=False)
    assert missing.returncode == 2 and "not found" in missing.stderr

    # The scheduled deployment's flow, run now: resumes e2e-submit from checkpoint 2.
    cont = stack.cli("submit", "--deployment", "continue-nightly", "--param",
                     "run_id=e2e-submit", "--param", "add_iterations=1", "--wait", "--logs",
                     check=False)
    assert cont.returncode == 0, cont.stdout + cont.stderr
    assert "resuming from checkpoint 2 for 1 more iteration" in cont.stdout
