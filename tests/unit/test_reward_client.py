"""LambdaRewardClient policies against a scripted boto3 stand-in (no network), and config."""

from __future__ import annotations

import io
import json
import time

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from rollart.config import ConfigError, RewardConfig, load_config
from rollart.rewards.client import (
    LambdaRewardClient,
    LocalRewardClient,
    RewardError,
    make_reward_client,
)


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "Invoke")


class Scripted:
    """Plays back a list of outcomes: an exception to raise, or (payload, function_error)."""

    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def invoke(self, **kwargs):
        self.calls.append(kwargs)
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        payload, ferr = out
        resp = {"StatusCode": 200, "Payload": io.BytesIO(json.dumps(payload).encode())}
        if ferr:
            resp["FunctionError"] = ferr
        return resp


def _client(stub, **kw) -> LambdaRewardClient:
    return LambdaRewardClient("fn", client=stub, backoff_base_s=0.001, backoff_max_s=0.004,
                              **kw)


def test_throttles_and_5xx_are_retried_with_backoff():
    stub = Scripted(_client_error(429, "TooManyRequestsException"),
                    _client_error(500, "ServiceException"),
                    ReadTimeoutError(endpoint_url="http://x"),
                    ({"reward": 0.5, "extra": 2, "note": "text"}, None))
    c = _client(stub, alias="live")
    assert c.invoke({"sample_id": "s"}) == {"reward": 0.5, "extra": 2, "note": "text"}
    assert c.stats == {"invocations": 4, "throttles": 1, "retries": 3, "function_errors": 0,
                       "server_errors": 1, "transport_errors": 1}
    assert stub.calls[0]["Qualifier"] == "live" and stub.calls[0]["FunctionName"] == "fn"
    assert json.loads(stub.calls[0]["Payload"]) == {"sample_id": "s"}


def test_backoff_is_jittered_exponential_and_capped():
    c = LambdaRewardClient("fn", client=Scripted(), backoff_base_s=0.1, backoff_max_s=1.0)
    for attempt, step in [(0, 0.1), (1, 0.2), (2, 0.4), (6, 1.0), (500, 1.0)]:
        waits = {c._backoff(attempt) for _ in range(50)}
        assert all(step / 2 <= w <= step for w in waits) and len(waits) > 1


def test_transient_errors_retried_for_the_time_budget_and_4xx_is_not_retried():
    # Far more throttles than max_retries: the time budget, not a count, ends the retries.
    stub = Scripted(*[_client_error(429, "TooManyRequestsException")] * 1000)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"gave up after \d+ attempts in 0\.[23]s "
                       r"\(reward.retry_timeout_s=0.2\); last error TooManyRequests"):
        _client(stub, max_retries=2, retry_timeout_s=0.2).invoke({"sample_id": "s9"})
    assert 0.2 <= time.monotonic() - t0 < 0.5 and len(stub.calls) > 3
    stub = Scripted(_client_error(400, "InvalidRequestContentException"))
    with pytest.raises(RewardError, match="'fn' for sample s1"):
        _client(stub).invoke({"sample_id": "s1"})
    assert len(stub.calls) == 1


def test_function_error_policies():
    err = ({"errorType": "KeyError", "errorMessage": "'answer'"}, "Unhandled")
    assert _client(Scripted(err), on_error="zero").invoke({}) == \
        {"reward": 0.0, "reward_error": 1.0}
    with pytest.raises(RewardError, match=r"'fn' failed for sample s2: KeyError: 'answer'"):
        _client(Scripted(err), on_error="fail").invoke({"sample_id": "s2"})
    retry = _client(Scripted(err, ({"reward": 1.0}, None)), on_error="retry", max_retries=1)
    assert retry.invoke({})["reward"] == 1.0 and retry.stats["function_errors"] == 1
    with pytest.raises(RewardError, match="returned no 'reward'"):
        _client(Scripted(({"score": 1}, None))).invoke({})


def test_submit_returns_futures_as_episodes_finish():
    stub = Scripted(({"reward": 1.0}, None), ({"reward": 0.0}, None))
    with _client(stub, max_concurrency=1) as c:
        fut = c.submit_event({"sample_id": "a"})
        assert fut.result(timeout=5) == {"reward": 1.0}
        assert c.submit_event({"sample_id": "b"}).result(timeout=5)["reward"] == 0.0


def test_reward_config_and_factory(monkeypatch):
    monkeypatch.delenv("ROLLART_LAMBDA_ACCESS_KEY_ID", raising=False)
    with pytest.raises(RewardError, match="ROLLART_LAMBDA_ACCESS_KEY_ID"):  # fail closed
        LambdaRewardClient("fn", endpoint_url="http://127.0.0.1:9")
    monkeypatch.setenv("ROLLART_LAMBDA_ACCESS_KEY_ID", "ROLLARTKEY")
    monkeypatch.setenv("ROLLART_LAMBDA_SECRET_ACCESS_KEY", "not-a-real-secret")
    cfg = load_config("configs/default.yaml", [
        "reward.backend=lambda", "reward.function_name=my-fn", "reward.alias=live",
        "reward.endpoint_url=http://127.0.0.1:9", "reward.max_concurrency=3"])
    client = make_reward_client(cfg.reward)
    assert isinstance(client, LambdaRewardClient) and client.function_name == "my-fn"
    assert client.alias == "live" and make_reward_client(cfg.reward) is client  # cached
    assert client.retry_timeout_s == 60.0 and client.backoff_max_s == 2.0  # documented defaults
    assert isinstance(make_reward_client(RewardConfig()), LocalRewardClient)
    for bad, msg in [("reward.function=nope", "reward.function 'nope'"),
                     ("reward.on_error=maybe", "reward.on_error"),
                     ("reward.endpoint_url=localhost:9", "reward.endpoint_url"),
                     ("reward.max_concurrency=0", "reward.max_concurrency"),
                     ("reward.retry_timeout_s=0", "reward.retry_timeout_s")]:
        with pytest.raises(ConfigError, match=msg):
            load_config("configs/default.yaml", [bad])
    with pytest.raises(ConfigError, match="reward.function_name 'a/b'"):
        load_config("configs/default.yaml", ["reward.backend=lambda", "reward.function_name=a/b"])
