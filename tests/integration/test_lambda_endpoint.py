"""boto3 -> local Lambda endpoint -> awslambdaric worker processes -> reward handlers.

Everything real: the HTTP Invoke and Runtime APIs on loopback, `python -m awslambdaric`
workers, the production `LambdaRewardClient`. Functions use short timeouts and idle periods so
the whole module runs in a few seconds.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from infra.lambda_endpoint import LocalLambda
from infra.lambda_functions import FunctionSpec
from infra.lambda_package import build_package, deploy, lambda_client
from rollart.rewards.client import LambdaRewardClient, RewardError, make_boto3_client
from rollart.rewards.handlers import env_outcome
from rollart.types import Trajectory

pytestmark = pytest.mark.integration


def _wait_until(cond, timeout: float = 10.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


@pytest.fixture(scope="module")
def lam():
    specs = [
        FunctionSpec("env_outcome", "env_outcome", concurrency=4),
        FunctionSpec("boom", "raise", concurrency=4),
        FunctionSpec("slow", "sleep", concurrency=2, timeout_s=1.0),
        FunctionSpec("one", "sleep", concurrency=1, timeout_s=5.0),
        FunctionSpec("elastic", "sleep", concurrency=6, timeout_s=5.0),
        FunctionSpec("crash", "exit", concurrency=1),
        FunctionSpec("broken", "no_such_module.handler", concurrency=1),
    ]
    with LocalLambda(specs, idle_timeout_s=0.6) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def boto(lam):
    return make_boto3_client(lam.url, "us-east-1", timeout_s=10, max_concurrency=8,
                             credentials=lam.credentials)


def _traj(i: int) -> Trajectory:
    return Trajectory(sample_id=f"t/{i}/0@0", task="frozenlake", env_id="FrozenLake-v1",
                      group_id="g", seed=i, iteration=0, token_ids=[1], loss_mask=[0],
                      behaviour_logprobs=[0.0], token_versions=[-1], task_return=1.0,
                      format_penalty=-0.1 * i, success=True)


def test_success_matches_in_process_handler_and_is_fast(lam, boto):
    event = {"task_return": 1.0, "format_penalty": -0.3, "num_turns": 3, "success": True}
    resp = boto.invoke(FunctionName="env_outcome", Payload=json.dumps(event).encode())
    assert resp["StatusCode"] == 200 and "FunctionError" not in resp
    assert resp["ExecutedVersion"] == "$LATEST"
    assert json.loads(resp["Payload"].read()) == pytest.approx(env_outcome(event))
    # Warm calls: a Nagle/delayed-ACK stall would put every call at >= 40 ms.
    lat = []
    for _ in range(10):
        t0 = time.perf_counter()
        boto.invoke(FunctionName="env_outcome", Payload=b"{}")["Payload"].read()
        lat.append(time.perf_counter() - t0)
    assert statistics.median(lat) < 0.03, lat


def test_handler_exception_reported_like_lambda(lam, boto):
    resp = boto.invoke(FunctionName="boom", Payload=b'{"message": "bad reward"}')
    assert resp["StatusCode"] == 200 and resp["FunctionError"] == "Unhandled"
    err = json.loads(resp["Payload"].read())
    assert err["errorType"] == "ValueError" and err["errorMessage"] == "bad reward"
    assert any("raise_error" in line for line in err["stackTrace"])


def test_init_error_and_crash(lam, boto):
    resp = boto.invoke(FunctionName="broken", Payload=b"{}")
    err = json.loads(resp["Payload"].read())
    assert resp["FunctionError"] == "Unhandled"
    assert err["errorType"] == "Runtime.ImportModuleError" and "no_such_module" in \
        err["errorMessage"]
    resp = boto.invoke(FunctionName="crash", Payload=b'{"code": 7}')
    err = json.loads(resp["Payload"].read())
    assert err["errorType"] == "Runtime.ExitError" and "exit status 7" in err["errorMessage"]


def test_timeout_kills_worker_then_recovers(lam, boto):
    t0 = time.perf_counter()
    resp = boto.invoke(FunctionName="slow", Payload=b'{"cost_s": 30}')
    elapsed = time.perf_counter() - t0
    err = json.loads(resp["Payload"].read())
    assert resp["FunctionError"] == "Unhandled" and err["errorType"] == "Sandbox.Timedout"
    assert "Task timed out after 1.00 seconds" in err["errorMessage"]
    assert 0.9 < elapsed < 3.0
    assert lam.metrics()["functions"]["slow"]["timeouts"] == 1
    resp = boto.invoke(FunctionName="slow", Payload=b'{"cost_s": 0.01}')
    assert "FunctionError" not in resp and json.loads(resp["Payload"].read())["reward"] == 1.0


def test_throttle_429_then_client_backoff(lam, boto):
    before = lam.metrics()["functions"]["one"]["throttles"]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(boto.invoke, FunctionName="one", Payload=b'{"cost_s": 0.8}')
        time.sleep(0.3)
        with pytest.raises(ClientError) as info:
            boto.invoke(FunctionName="one", Payload=b'{"cost_s": 0}')
        assert first.result()["StatusCode"] == 200
    err = info.value.response
    assert err["Error"]["Code"] == "TooManyRequestsException"
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert err["ResponseMetadata"]["HTTPHeaders"]["x-amzn-errortype"] == \
        "TooManyRequestsException"
    assert err["Reason"] == "ReservedFunctionConcurrentInvocationLimitExceeded"
    # The production client: 4 at once against concurrency 1 -> throttled, backs off, all land.
    with LambdaRewardClient("one", endpoint_url=lam.url, credentials=lam.credentials,
                            max_concurrency=4, max_retries=20,
                            backoff_base_s=0.02, backoff_max_s=0.2) as client:
        trajs = [_traj(i) for i in range(4)]
        client.score(trajs)
    assert all(t.reward == 1.0 for t in trajs)
    assert client.stats["throttles"] > 0 and client.stats["retries"] >= client.stats["throttles"]
    assert lam.metrics()["functions"]["one"]["throttles"] > before


def test_error_policies(lam):
    trajs = [_traj(0)]
    with LambdaRewardClient("boom", endpoint_url=lam.url, credentials=lam.credentials,
                            on_error="zero") as client:
        client.score(trajs)
    assert trajs[0].reward == 0.0 and trajs[0].reward_details == {"reward_error": 1.0}
    with LambdaRewardClient("boom", endpoint_url=lam.url, credentials=lam.credentials,
                            on_error="fail") as client:
        with pytest.raises(RewardError, match=r"'boom' failed for sample t/0/0@0: ValueError"):
            client.score([_traj(0)])
        assert client.stats["invocations"] == 1
    with LambdaRewardClient("boom", endpoint_url=lam.url, credentials=lam.credentials,
                            on_error="retry", max_retries=2,
                            backoff_base_s=0.01) as client:
        with pytest.raises(RewardError, match="boom"):
            client.score([_traj(0)])
        assert client.stats["invocations"] == 3 and client.stats["retries"] == 2
    with LambdaRewardClient("nope", endpoint_url=lam.url,
                            credentials=lam.credentials) as client:  # 404: no retries
        with pytest.raises(RewardError, match="'nope' for sample"):
            client.score([_traj(0)])
        assert client.stats["invocations"] == 1


def test_scale_out_then_to_zero(lam):
    with LambdaRewardClient("elastic", endpoint_url=lam.url, credentials=lam.credentials,
                            max_concurrency=6) as client:
        futures = [client.submit(_traj(i)) for i in range(12)]
        assert _wait_until(lambda: lam.metrics()["functions"]["elastic"]["live_workers"] >= 4,
                           timeout=5.0)
        scored = [f.result(timeout=20) for f in futures]
    assert all(t.reward == 1.0 and t.timings["reward_s"] > 0 for t in scored)
    m = lam.metrics()["functions"]["elastic"]
    assert 4 <= m["peak_workers"] <= 6 and m["throttles"] == 0
    assert _wait_until(lambda: lam.metrics()["functions"]["elastic"]["live_workers"] == 0,
                       timeout=5.0)


def test_package_deploy_invoke_alias(lam, tmp_path):
    pkg = build_package(tmp_path / "rewards.zip", no_deps=True)
    assert "rollart/rewards/handlers.py" in pkg.files
    assert "rollart/rewards/client.py" not in pkg.files  # handlers must not need it
    out = deploy(pkg.path, "rewards-env", "env_outcome", alias="live", reserved_concurrency=3,
                 timeout_s=10, endpoint_url=lam.url, credentials=lam.credentials)
    assert out["version"] == "1" and out["handler"] == "rollart.rewards.handlers.env_outcome"
    boto = make_boto3_client(lam.url, "us-east-1", 10, 2, lam.credentials)
    event = {"task_return": 1.0, "format_penalty": -0.2, "num_turns": 2}
    resp = boto.invoke(FunctionName="rewards-env", Qualifier="live",
                       Payload=json.dumps(event).encode())
    assert resp["ExecutedVersion"] == "1"
    assert json.loads(resp["Payload"].read())["reward"] == pytest.approx(0.9)
    ctl = lambda_client(lam.url, "us-east-1", lam.credentials)
    fn = ctl.get_function(FunctionName="rewards-env")
    assert fn["Concurrency"]["ReservedConcurrentExecutions"] == 3
    assert fn["Configuration"]["CodeSha256"] == pkg.code_sha256
    # Redeploy with a new configuration: same code (not re-uploaded), version 2, alias moves.
    out = deploy(pkg.path, "rewards-env", "env_outcome", alias="live", timeout_s=10,
                 env={"OMP_NUM_THREADS": "2"}, endpoint_url=lam.url, credentials=lam.credentials)
    assert out["version"] == "2" and out["code_updated"] is False
    assert ctl.get_alias(FunctionName="rewards-env", Name="live")["FunctionVersion"] == "2"
    resp = boto.invoke(FunctionName="rewards-env:live", Payload=b"{}")
    assert resp["ExecutedVersion"] == "2"
    # The function runs from the unpacked zip, not from this checkout: client.py is not there.
    ctl.update_function_configuration(FunctionName="rewards-env",
                                      Handler="rollart.rewards.client.reward_event")
    resp = boto.invoke(FunctionName="rewards-env", Payload=b"{}")
    assert json.loads(resp["Payload"].read())["errorType"] == "Runtime.ImportModuleError"
