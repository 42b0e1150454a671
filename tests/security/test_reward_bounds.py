"""Reward handlers are bounded in time and memory wherever they run.

Locally (the default backend) the handler is called from a Dask worker thread, where
math-verify's own timeout (signal.alarm) cannot work: `9^{9^{9^{9}}}` ran for minutes. The local
client runs every handler in a warm child process (rollart/rewards/guard.py) that is killed
past `reward.timeout_s` and capped at `reward.memory_mb`; a handler that dies takes only its
own process. Each failure follows `reward.on_error`. On the local Lambda endpoint the function
timeout kills the worker (tests/integration/test_lambda_endpoint.py) and the function's memory
size caps it (here).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import threading
import time

import pytest

from infra.lambda_endpoint import LocalLambda
from infra.lambda_functions import FunctionSpec
from rollart.config import RewardConfig
from rollart.rewards.client import (
    LocalRewardClient,
    RewardError,
    make_boto3_client,
    make_reward_client,
)
from rollart.rewards.registry import register_handler

BOMB = {"sample_id": "bomb", "response": "$9^{9^{9^{9}}}$", "answer": "2"}
ALLOCATE = "rollart.rewards.diagnostic.allocate"


def _in_thread(fn):
    """fn() on a worker thread (as a Dask task or an episode thread calls rewards):
    (result or exception, seconds)."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except Exception as err:  # noqa: BLE001 - returned to the test
            out["value"] = err
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive(), "the reward call is still running after 60 s"
    return out["value"], out["s"]


def test_math_bomb_off_the_main_thread_ends_at_the_timeout():
    client = LocalRewardClient("math", timeout_s=2.0, on_error="zero")
    assert client.invoke({"response": "\\boxed{4}", "answer": "4"})["reward"] == 1.0  # warm
    result, took = _in_thread(lambda: client.invoke(BOMB))
    assert result == {"reward": 0.0, "reward_error": 1.0}, result
    assert 1.9 < took < 8.0, took  # the hard timeout, not math-verify's (5 s) nor minutes
    assert client.stats["timeouts"] == 1
    # `fail` raises at once, naming the function, the sample and why.
    strict = LocalRewardClient("math", timeout_s=1.0, on_error="fail")
    err, took = _in_thread(lambda: strict.invoke(BOMB))
    assert isinstance(err, RewardError) and "timed out after 1s" in str(err), err
    assert "'math'" in str(err) and "bomb" in str(err) and took < 7.0
    # The handler process that hung is gone; the next call gets a fresh one and scores.
    assert client.invoke({"response": "\\boxed{4}", "answer": "4"})["reward"] == 1.0


def test_memory_is_capped_and_the_caller_keeps_its_own():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    client = LocalRewardClient(ALLOCATE, memory_mb=256, on_error="zero")
    assert client.invoke({"mb": 32})["reward"] == 1.0
    result, _ = _in_thread(lambda: client.invoke({"mb": 2048}))
    assert result == {"reward": 0.0, "reward_error": 1.0}
    strict = LocalRewardClient(ALLOCATE, memory_mb=256, on_error="fail")
    with pytest.raises(RewardError, match="MemoryError"):
        strict.invoke({"mb": 2048})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB
    assert client.invoke({"mb": 32})["reward"] == 1.0  # a fresh process serves again


def test_a_dying_or_raising_handler_follows_on_error():
    pid = os.getpid()
    died = LocalRewardClient("exit", on_error="zero")  # os._exit in the handler
    assert died.invoke({"code": 3})["reward_error"] == 1.0 and os.getpid() == pid
    retry = LocalRewardClient("raise", on_error="retry", max_retries=2)
    with pytest.raises(RewardError, match="ValueError: boom"):
        retry.invoke({"message": "boom"})
    assert retry.stats["invocations"] == 3  # the first try and two retries
    # A handler only this process knows (a lambda) could not run in a fresh process: refused
    # when the client is made, not on every call.
    name = "in-process-only-" + secrets.token_hex(4)
    register_handler(name)(lambda event, context=None: {"reward": 1.0})
    with pytest.raises(ValueError, match="cannot be imported by a fresh process"):
        LocalRewardClient(name)


def test_the_runs_reward_settings_reach_the_client():
    cfg = RewardConfig(function="sleep", timeout_s=1.0, memory_mb=300, on_error="zero",
                       max_retries=1)
    client = make_reward_client(cfg)
    assert isinstance(client, LocalRewardClient)
    assert (client.timeout_s, client.memory_mb, client.on_error, client.max_retries) == \
        (1.0, 300, "zero", 1)
    result, took = _in_thread(lambda: client.invoke({"cost_s": 30}))
    assert result["reward_error"] == 1.0 and took < 6.0, (result, took)


def test_lambda_endpoint_caps_a_functions_memory():
    spec = FunctionSpec("hog", ALLOCATE, concurrency=1, timeout_s=20.0, memory_mb=128)
    with LocalLambda([spec], idle_timeout_s=5) as lam:
        boto = make_boto3_client(lam.url, "us-east-1", 30, 1, lam.credentials)
        small = boto.invoke(FunctionName="hog", Payload=json.dumps({"mb": 16}).encode())
        assert "FunctionError" not in small and json.loads(small["Payload"].read())["mb"] == 16
        big = boto.invoke(FunctionName="hog", Payload=json.dumps({"mb": 1024}).encode())
        assert big.get("FunctionError") == "Unhandled"
        assert "MemoryError" in big["Payload"].read().decode()
