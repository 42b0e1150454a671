"""Reward clients: turn finished trajectories into events, call a handler, attach the reward.

- `LocalRewardClient`: the handler on this machine (no network; the default backend), in a
  warm child process with a hard timeout and a memory cap (`rollart.rewards.guard`).
- `LambdaRewardClient`: boto3 `invoke` against AWS Lambda or the local endpoint
  (`infra/lambda_endpoint.py`, through `endpoint_url`), with bounded concurrency, a per-call
  timeout, jittered exponential backoff on throttles/5xx/transport errors for a time budget
  (`reward.retry_timeout_s`) and a policy for handler errors.

Both offer `submit(traj) -> Future` so a rollout can score each episode the moment it ends and
overlap scoring with generation; `score(trajs)` is submit-all-then-wait.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollart.rewards.registry import BUILTINS, HANDLERS, get_handler
from rollart.types import Trajectory

# Retry jitter draws from its own generator: the run's global `random` state is checkpointed
# (rng.json), and a retry that happened in one run and not in its resumed twin made them differ.
_JITTER = random.Random()

if TYPE_CHECKING:
    from rollart.config import RewardConfig

log = logging.getLogger(__name__)
RETRYABLE_CODES = {"TooManyRequestsException", "ServiceException", "ResourceNotReadyException",
                   "EC2ThrottledException", "ThrottlingException", "RequestTimeoutException"}
# The local endpoint's key pair, kept apart from AWS_* (the S3 keys): clients of a loopback
# endpoint sign with these, and they are never sent to a real AWS endpoint.
LOCAL_KEY_ENV = "ROLLART_LAMBDA_ACCESS_KEY_ID"
LOCAL_SECRET_ENV = "ROLLART_LAMBDA_SECRET_ACCESS_KEY"


@dataclass(frozen=True)
class LambdaCredentials:
    """The key pair of the local Lambda endpoint (SigV4). repr never shows the secret."""

    access_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def generate(cls) -> LambdaCredentials:
        return cls("ROLLART" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))

    @classmethod
    def from_env(cls, env: Any = None) -> LambdaCredentials | None:
        """From `env`, or else what this process holds (rollart.secrets: the run's scoped
        secrets, then the environment)."""
        if env is None:
            from rollart.secrets import lookup

            key, secret = lookup(LOCAL_KEY_ENV), lookup(LOCAL_SECRET_ENV)
        else:
            key, secret = env.get(LOCAL_KEY_ENV), env.get(LOCAL_SECRET_ENV)
        return cls(key, secret) if key and secret else None

    def env(self) -> dict[str, str]:
        """Environment for processes that call the local endpoint."""
        return {LOCAL_KEY_ENV: self.access_key, LOCAL_SECRET_ENV: self.secret_key}


def reward_event(traj: Trajectory) -> dict[str, Any]:
    return {
        "sample_id": traj.sample_id,
        "task": traj.task,
        "env_return": traj.env_return,
        "task_return": traj.task_return,
        "format_penalty": traj.format_penalty,
        "success": traj.success,
        "format_errors": traj.format_errors,
        "num_turns": traj.num_turns,
        "final_response": traj.turns[-1].response if traj.turns else "",
    }


def _apply(traj: Trajectory, result: dict[str, Any]) -> None:
    traj.reward = float(result["reward"])
    # Shards store details as floats: keep the numeric ones (bools count), drop the rest.
    traj.reward_details = {k: float(v) for k, v in result.items()
                           if k != "reward" and isinstance(v, int | float)}


class RewardClient(Protocol):
    def score(self, trajs: list[Trajectory]) -> list[Trajectory]: ...

    def submit(self, traj: Trajectory) -> Future[Trajectory]: ...


class RewardError(RuntimeError):
    """A reward could not be computed; the message names the function and the sample."""


class LocalRewardClient:
    """Runs the handler on this machine, in a warm child process bounded in time and memory
    (`rollart.rewards.guard`): a handler that hangs (math-verify's own timeout works only on a
    main thread), allocates without bound or dies costs its call, never the caller's thread or
    worker. Such a failure, or the handler's own exception, follows `on_error` as a Lambda
    FunctionError does: "retry" (up to max_retries, then fail), "zero" (reward 0.0 and
    reward_details["reward_error"] = 1), "fail" (raise RewardError at once)."""

    def __init__(self, function: str = "env_outcome", *, timeout_s: float = 60.0,
                 memory_mb: int = 2048, on_error: str = "retry", max_retries: int = 5,
                 max_concurrency: int = 32) -> None:
        if on_error not in ("retry", "zero", "fail"):
            raise ValueError(f"on_error must be retry, zero or fail, got {on_error!r}")
        self.function = function
        self.path = _importable_path(function)
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.on_error, self.max_retries = on_error, max_retries
        self.max_concurrency = max_concurrency
        self.stats = {"invocations": 0, "function_errors": 0, "timeouts": 0}

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        """One event -> the handler's result dict, applying the error policy."""
        from rollart.rewards.guard import HandlerFailure, HandlerTimeout, get_pool

        pool = get_pool(self.memory_mb, self.max_concurrency)
        sample = event.get("sample_id", "?")
        failures = 0
        while True:
            self.stats["invocations"] += 1
            try:
                result = pool.call(self.path, event, self.timeout_s)
            except HandlerFailure as err:
                self.stats["function_errors"] += 1
                self.stats["timeouts"] += isinstance(err, HandlerTimeout)
                if self.on_error == "retry" and failures < self.max_retries:
                    failures += 1
                    continue
                if self.on_error == "zero":
                    log.warning("reward function %r failed for sample %s, scored 0: %s",
                                self.function, sample, err)
                    return {"reward": 0.0, "reward_error": 1.0}
                raise RewardError(f"reward function {self.function!r} failed for sample "
                                  f"{sample}: {err}") from err
            if "reward" not in result:
                raise RewardError(f"reward function {self.function!r} returned no 'reward' "
                                  f"for sample {sample}: {str(result)[:200]}")
            return result

    def _score_one(self, traj: Trajectory) -> Trajectory:
        t0 = time.perf_counter()
        _apply(traj, self.invoke(reward_event(traj)))
        traj.timings["reward_s"] = time.perf_counter() - t0
        return traj

    def submit(self, traj: Trajectory) -> Future[Trajectory]:
        """Scores now (the caller's thread waits for the handler's process) and returns a
        completed future."""
        fut: Future[Trajectory] = Future()
        try:
            fut.set_result(self._score_one(traj))
        except Exception as err:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(err)
        return fut

    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        for traj in trajs:
            self._score_one(traj)
        return trajs


def _importable_path(function: str) -> str:
    """The `module.function` a fresh process can import for `function`. A handler registered
    only in this process (a lambda, a closure, one defined in __main__) cannot run anywhere
    else, so it is refused here rather than failing every call."""
    if function in BUILTINS:
        return BUILTINS[function]
    fn = get_handler(function)  # unknown names fail here, as before
    if function not in HANDLERS:  # a dotted path that imported: importable by definition
        return function
    path = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    try:
        same = path.split(".", 1)[0] != "__main__" and get_handler(path) is fn
    except KeyError:
        same = False
    if not same:
        raise ValueError(f"reward handler {function!r} ({path}) cannot be imported by a "
                         "fresh process, where local rewards run: define it at the top level "
                         "of an importable module")
    return path


class LambdaRewardClient:
    """Invokes a Lambda function per episode (RequestResponse), at most `max_concurrency` at once.

    Transient failures (throttles, 5xx, transport errors: the endpoint down, restarting or slow)
    are retried with jittered exponential backoff (capped at `backoff_max_s`) until
    `retry_timeout_s` has passed since the episode's first attempt: an endpoint restart or a
    throttling burst costs latency, not the run. A handler error (`FunctionError` in the
    response) follows `on_error`: "retry" (up to max_retries, then fail), "zero" (reward 0.0 and
    reward_details["reward_error"] = 1), "fail" (raise RewardError at once).
    """

    def __init__(self, function_name: str, *, alias: str | None = None,
                 endpoint_url: str | None = None, region: str = "us-east-1",
                 max_concurrency: int = 32, timeout_s: float = 60.0, max_retries: int = 5,
                 on_error: str = "retry", backoff_base_s: float = 0.05,
                 backoff_max_s: float = 2.0, retry_timeout_s: float = 60.0,
                 client: Any = None, credentials: LambdaCredentials | None = None) -> None:
        if on_error not in ("retry", "zero", "fail"):
            raise ValueError(f"on_error must be retry, zero or fail, got {on_error!r}")
        self.function_name, self.alias = function_name, alias
        self.max_retries, self.on_error = max_retries, on_error
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.retry_timeout_s = retry_timeout_s
        self.client = client or make_boto3_client(endpoint_url, region, timeout_s,
                                                  max_concurrency, credentials)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="reward")
        self._lock = threading.Lock()
        self.stats = {"invocations": 0, "throttles": 0, "retries": 0, "function_errors": 0,
                      "server_errors": 0, "transport_errors": 0}

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _backoff(self, attempt: int) -> float:
        """Equal jitter: half the exponential step is fixed (progress), half random (spread)."""
        step = min(self.backoff_max_s, self.backoff_base_s * (2 ** min(attempt, 30)))
        return step / 2 + _JITTER.uniform(0.0, step / 2)

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        """One event -> the handler's result dict, applying the retry and error policies."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            EndpointConnectionError,
            ReadTimeoutError,
        )

        sample = event.get("sample_id", "?")
        where = f"reward function {self.function_name!r}" + (
            f" (qualifier {self.alias!r})" if self.alias else "")
        kwargs: dict[str, Any] = {"FunctionName": self.function_name,
                                  "InvocationType": "RequestResponse",
                                  "Payload": json.dumps(event).encode()}
        if self.alias:
            kwargs["Qualifier"] = self.alias
        t0 = time.monotonic()
        deadline = t0 + self.retry_timeout_s
        last, attempt, handler_errors = "", 0, 0
        while True:
            if attempt:
                # Never sleep past the budget: the last attempt lands right at the deadline.
                wait = min(self._backoff(attempt - 1), deadline - time.monotonic())
                if wait < 0:
                    raise RewardError(
                        f"{where} for sample {sample}: gave up after {attempt} attempts in "
                        f"{time.monotonic() - t0:.1f}s (reward.retry_timeout_s="
                        f"{self.retry_timeout_s:g}); last error {last}")
                self._count("retries")
                time.sleep(wait)
            attempt += 1
            self._count("invocations")
            try:
                resp = self.client.invoke(**kwargs)
            except ClientError as err:
                code = err.response.get("Error", {}).get("Code", "")
                status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if code == "TooManyRequestsException" or status == 429:
                    self._count("throttles")
                elif code in RETRYABLE_CODES or status >= 500:
                    self._count("server_errors")
                else:  # 4xx: a configuration problem; retrying cannot help
                    raise RewardError(f"{where} for sample {sample}: {err}") from err
                last = f"{code or status}: {err}"
                continue
            except (ReadTimeoutError, ConnectionClosedError, EndpointConnectionError) as err:
                # The endpoint is down, restarting or hung: the same as a 5xx for us.
                self._count("transport_errors")
                last = f"{type(err).__name__}: {err}"
                continue
            body = resp["Payload"].read()
            if resp.get("FunctionError"):
                self._count("function_errors")
                info = _error_text(body)
                if self.on_error == "retry" and handler_errors < self.max_retries:
                    handler_errors += 1
                    last = info
                    continue
                if self.on_error == "zero":
                    log.warning("%s failed for sample %s, scored 0: %s", where, sample, info)
                    return {"reward": 0.0, "reward_error": 1.0}
                raise RewardError(f"{where} failed for sample {sample}: {info}")
            result = json.loads(body)
            if not isinstance(result, dict) or "reward" not in result:
                raise RewardError(f"{where} returned no 'reward' for sample {sample}: "
                                  f"{body[:200]!r}")
            return result

    def _score_one(self, traj: Trajectory, submitted: float) -> Trajectory:
        t0 = time.perf_counter()
        _apply(traj, self.invoke(reward_event(traj)))
        traj.timings["reward_queue_s"] = t0 - submitted
        traj.timings["reward_s"] = time.perf_counter() - t0
        return traj

    def submit(self, traj: Trajectory) -> Future[Trajectory]:
        """Queue one episode for scoring now; the future resolves to the scored trajectory."""
        return self._pool.submit(self._score_one, traj, time.perf_counter())

    def submit_event(self, event: dict[str, Any]) -> Future[dict[str, Any]]:
        """A raw event (any handler's schema) -> future of the handler's result dict."""
        return self._pool.submit(self.invoke, event)

    def score_async(self, trajs: list[Trajectory]) -> list[Future[Trajectory]]:
        return [self.submit(t) for t in trajs]

    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        futures = self.score_async(trajs)
        for fut in futures:
            fut.result()  # the first failure raises (RewardError names function and sample)
        return trajs

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LambdaRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body)
        return f"{err.get('errorType', 'Error')}: {err.get('errorMessage', '')}".strip()
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", errors="replace")


def is_loopback(endpoint_url: str | None) -> bool:
    from urllib.parse import urlparse

    host = urlparse(endpoint_url).hostname if endpoint_url else None
    return host in ("127.0.0.1", "localhost", "::1")


def signing_credentials(endpoint_url: str | None,
                        credentials: LambdaCredentials | None = None) -> dict[str, str]:
    """boto3 client kwargs for the keys to sign with. A loopback endpoint is the local one: its
    own key pair (explicit, else ROLLART_LAMBDA_* from the environment), refused when there is
    none; anything else uses boto3's usual chain (environment, profile, role)."""
    if not is_loopback(endpoint_url):  # AWS: keys held out of the environment, else the chain
        from rollart.secrets import storage_keys

        held = storage_keys()
        return {} if held is None else {"aws_access_key_id": held[0],
                                        "aws_secret_access_key": held[1],
                                        "aws_session_token": held[2]}
    creds = credentials or LambdaCredentials.from_env()
    if creds is None:
        raise RewardError(f"the local Lambda endpoint {endpoint_url} requires signed requests: "
                          f"set {LOCAL_KEY_ENV} and {LOCAL_SECRET_ENV} (the stack's key pair, "
                          "in <state dir>/lambda-credentials.json; `rollart up` exports them "
                          "to its workers)")
    return {"aws_access_key_id": creds.access_key,
            "aws_secret_access_key": creds.secret_key, "aws_session_token": None}


def make_boto3_client(endpoint_url: str | None, region: str, timeout_s: float,
                      max_concurrency: int, credentials: LambdaCredentials | None = None) -> Any:
    """A Lambda client with our own retry policy (botocore's is off) and a socket pool as wide
    as our concurrency. Every request is SigV4-signed, the local endpoint's included."""
    import boto3
    from botocore.config import Config

    opts: dict[str, Any] = {
        "read_timeout": timeout_s, "connect_timeout": min(timeout_s, 10.0),
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "max_pool_connections": max_concurrency, "tcp_keepalive": True,
    }
    session = boto3.session.Session()
    return session.client("lambda", region_name=region, endpoint_url=endpoint_url,
                          config=Config(**opts),
                          **signing_credentials(endpoint_url, credentials))


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def make_reward_client(cfg: RewardConfig) -> LocalRewardClient | LambdaRewardClient:
    """The client for a RewardConfig. Lambda clients are cached per config in this process, so
    a long-lived worker reuses its connection pool and threads across iterations."""
    if cfg.backend == "local":
        return LocalRewardClient(cfg.function, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb,
                                 on_error=cfg.on_error, max_retries=cfg.max_retries,
                                 max_concurrency=cfg.max_concurrency)
    key = cfg.model_dump_json()
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = LambdaRewardClient(
                cfg.lambda_name, alias=cfg.alias, endpoint_url=cfg.endpoint_url,
                region=cfg.region, max_concurrency=cfg.max_concurrency, timeout_s=cfg.timeout_s,
                max_retries=cfg.max_retries, on_error=cfg.on_error,
                backoff_base_s=cfg.backoff_base_s, backoff_max_s=cfg.backoff_max_s,
                retry_timeout_s=cfg.retry_timeout_s)
        return _CLIENTS[key]
