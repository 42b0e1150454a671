"""The reward client survives a restart of the Lambda endpoint (issue 15, item 5).

The endpoint is the real one (`python -m infra.lambda_endpoint`, awslambdaric workers) in its
own process: it is stopped (SIGTERM) while an invocation is in flight and a new process is
started on the same port ~2 s later, as a cluster manager would bring it back. The production
`LambdaRewardClient` retries for `reward.retry_timeout_s`; with a tiny budget it gives up with
an error that names the function, the sample and the budget.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.prefect_server import free_port
from rollart.rewards.client import LambdaCredentials, LambdaRewardClient, RewardError

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CREDS = LambdaCredentials.generate()  # the key pair the endpoint verifies and clients sign with


def _endpoint(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.lambda_endpoint", "--port", str(port),
         "--function", "slow=sleep", "--concurrency", "2", "--timeout", "20"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **CREDS.env()})
    assert proc.stdout is not None
    assert "local Lambda endpoint on" in proc.stdout.readline()  # printed once listening
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)


def test_endpoint_restart_costs_latency_not_the_call():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = _endpoint(port)
    second = None
    try:
        with LambdaRewardClient("slow", endpoint_url=url, retry_timeout_s=30.0, timeout_s=20.0,
                                backoff_base_s=0.05, backoff_max_s=1.0,
                                credentials=CREDS) as client:
            t0 = time.monotonic()
            # In flight for 3 s: the endpoint goes away under it.
            fut = client.submit_event({"sample_id": "s/0", "cost_s": 3.0, "reward": 0.75})
            time.sleep(0.5)
            _stop(first)
            assert not fut.done()
            # While it is down, a client with a tiny budget fails, and says why.
            with LambdaRewardClient("slow", endpoint_url=url, retry_timeout_s=0.5,
                                    credentials=CREDS) as brief:
                t1 = time.monotonic()
                with pytest.raises(RewardError, match=r"'slow' for sample s/1: gave up after "
                                   r"\d+ attempts .*reward.retry_timeout_s=0.5\).*"
                                   r"EndpointConnectionError"):
                    brief.invoke({"sample_id": "s/1", "cost_s": 0.0})
                assert time.monotonic() - t1 < 2.0
            time.sleep(2.0)
            second = _endpoint(port)
            result = fut.result(timeout=30)
            elapsed = time.monotonic() - t0
        assert result["reward"] == 0.75
        assert elapsed > 2.5  # it waited for the new endpoint; the run did not fail
        failures = client.stats["server_errors"] + client.stats["transport_errors"]
        assert failures >= 1 and client.stats["retries"] >= failures
        assert client.stats["function_errors"] == 0  # the restart is no handler error
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                _stop(proc)
