"""Local AWS Lambda endpoint: the embedded default for reward functions.

One loopback HTTP server speaks the Lambda Invoke API (`POST /2015-03-31/functions/{name}/
invocations`, qualifiers by `:alias` or `?Qualifier=`) and the control-plane calls of
`rollart lambda deploy` (see lambda_control.py), so boto3 talks to it unchanged through
`endpoint_url`. Handlers run in worker processes driven by the real AWS runtime client
(`python -m awslambdaric module.handler`, one Runtime API port per worker; see
lambda_runtime_worker.py). Like Lambda, it:

- scales workers per function from zero up to the function's concurrency (reserved concurrency
  when set), and back to zero after `idle_timeout_s` without work;
- answers 429 TooManyRequestsException when a function has `concurrency` invocations in flight;
- reports handler errors as HTTP 200 + `X-Amz-Function-Error: Unhandled` + errorType,
  errorMessage, stackTrace; kills a worker past the function timeout (Sandbox.Timedout) and
  caps each worker's memory at the function's memory size (a handler past it fails);
- disables Nagle on every socket (headers and body are separate writes: ~40-90 ms otherwise);
- authenticates like AWS: every request but `GET /local/health` must carry a SigV4 signature
  made with the endpoint's key pair (`credentials`; 403 otherwise, see lambda_auth.py), a
  loopback Host, no browser Origin, and a Content-Length within the limits (413/400).

    with LocalLambda([FunctionSpec("env_outcome", "env_outcome", concurrency=8)]) as lam:
        make_boto3_client(lam.url, "us-east-1", 30, 8, lam.credentials).invoke(
            FunctionName="env_outcome")

CLI: `python -m infra.lambda_endpoint --port 9001 --function env_outcome=env_outcome`, with the
key pair in ROLLART_LAMBDA_ACCESS_KEY_ID / ROLLART_LAMBDA_SECRET_ACCESS_KEY.
Metrics: `LocalLambda.metrics()` or a signed `GET /local/metrics`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from infra.lambda_auth import check_host, verify_sigv4
from infra.lambda_control import FN, ControlPlane
from infra.lambda_functions import FUNCTION_ENV, ApiError, Function, FunctionSpec, split_name
from infra.lambda_runtime_worker import PASS_ENV, Invocation, Pool, VersionSpec
from rollart import secrets
from rollart.rewards.client import LambdaCredentials

# Lambda's own limits: 6 MB for a synchronous Invoke payload; a CreateFunction body carries a
# zip of at most 50 MB, base64-encoded inside JSON (~67 MB). Nothing larger is read.
MAX_INVOKE_BYTES = 6 * 1024 * 1024
MAX_CONTROL_BYTES = 70 * 1024 * 1024


class LocalLambda(ControlPlane):
    def __init__(self, functions: list[FunctionSpec] | tuple[FunctionSpec, ...] = (),
                 host: str = "127.0.0.1", port: int = 0, idle_timeout_s: float = 60.0,
                 init_timeout_s: float = 10.0, default_concurrency: int = 8,
                 region: str = "us-east-1",
                 credentials: LambdaCredentials | None = None) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the local Lambda endpoint listens on loopback only")
        self.host, self.port, self.region = host, port, region
        # The only key pair accepted; a fresh random one unless the caller shares its own.
        self.credentials = credentials or LambdaCredentials.generate()
        self.idle_timeout_s, self.init_timeout_s = idle_timeout_s, init_timeout_s
        self.default_concurrency = default_concurrency
        self._lock = threading.Lock()
        self._functions: dict[str, Function] = {}
        self._pools: dict[str, Pool] = {}
        self._stats: dict[str, dict[str, int]] = {}
        self._root = Path(tempfile.mkdtemp(prefix="rollart-lambda-"))
        (self._root / "logs").mkdir()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        for spec in functions:
            self.register(spec)

    # lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_dir(self) -> Path:
        return self._root / "logs"

    def start(self) -> LocalLambda:
        server = _ApiServer((self.host, self.port), _ApiHandler)
        server.lam = self
        self._server, self.port = server, server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.25},
                         name="lambda-api", daemon=True).start()
        threading.Thread(target=self._reap, name="lambda-reaper", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            pools = list(self._pools.values())
            for pool in pools:
                for inv in pool.queue:
                    inv.finish(b'{"errorType":"Runtime.Shutdown","errorMessage":"stopped"}',
                               "Unhandled")
                pool.queue.clear()
                for w in pool.workers:
                    w.kill()
        deadline = time.monotonic() + 5.0
        for pool in pools:
            for w in list(pool.workers):
                if w.proc is not None:
                    w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> LocalLambda:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # scaling -------------------------------------------------------------------------------
    def _env(self, spec: VersionSpec) -> dict[str, str]:
        import rollart

        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        # The function's own variables first (allowed names only, as every API path checks),
        # so nothing of it can replace what the endpoint sets below (PYTHONPATH, _HANDLER, ...).
        env.update({k: v for k, v in spec.env.items() if k in FUNCTION_ENV})
        if spec.code_dir:  # a deployed zip: its own code only, like /var/task
            env["PYTHONPATH"] = spec.code_dir
        else:  # a config-registered function: this project, plus whatever the caller had
            project = str(Path(rollart.__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [project, env.get("PYTHONPATH")]))
        env.update({"AWS_LAMBDA_FUNCTION_NAME": spec.function,
                    "AWS_LAMBDA_FUNCTION_VERSION": spec.version,
                    "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
                    "AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region,
                    "LAMBDA_TASK_ROOT": spec.code_dir or os.getcwd(), "_HANDLER": spec.handler,
                    "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
        return env

    def _stat(self, name: str) -> dict[str, int]:
        return self._stats.setdefault(name, {"invocations": 0, "throttles": 0, "errors": 0,
                                             "timeouts": 0, "cold_starts": 0,
                                             "peak_workers": 0})

    def _live(self, name: str) -> int:
        return sum(p.live() for p in self._pools.values() if p.spec.function == name)

    def _on_spawn(self, pool: Pool) -> None:
        st = self._stat(pool.spec.function)
        st["cold_starts"] += 1
        st["peak_workers"] = max(st["peak_workers"], self._live(pool.spec.function))

    def _pool_for(self, fn: Function, spec: VersionSpec) -> Pool:
        pool = self._pools.get(spec.revision)
        if pool is None:
            pool = Pool(spec, self._lock, fn.limit, self._env(spec), self.log_dir,
                        self._on_spawn)
            self._pools[spec.revision] = pool
        return pool

    def _reap(self) -> None:
        """Scale to zero: stop workers idle longer than idle_timeout_s (0 for stale code)."""
        tick = max(0.05, min(0.25, self.idle_timeout_s / 4))
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                current = {v.spec.revision for f in self._functions.values()
                           for v in (f.latest, *f.versions.values())}
                for rev, pool in list(self._pools.items()):
                    after = self.idle_timeout_s if rev in current else 0.0
                    for w in pool.workers:
                        if w.state == "idle" and not pool.queue and now - w.idle_since >= after:
                            w.kill()
                    if rev not in current and not pool.workers and not pool.queue:
                        del self._pools[rev]

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            fns = {}
            for name in sorted(set(self._stats) | set(self._functions)):
                fn = self._functions.get(name)
                fns[name] = {**self._stat(name), "live_workers": self._live(name),
                             "in_flight": fn.in_flight if fn else 0,
                             "concurrency": fn.limit() if fn else 0}
            total = {k: sum(f[k] for f in fns.values()) for k in
                     ("invocations", "throttles", "errors", "timeouts", "cold_starts",
                      "live_workers")}
            return {"functions": fns, **total}

    # data plane ----------------------------------------------------------------------------
    def invoke(self, raw: str, qualifier: str | None, payload: bytes,
               invocation_type: str = "RequestResponse") -> tuple[int, dict[str, str], bytes]:
        name, qualifier = split_name(raw, qualifier)
        with self._lock:
            self._check_running()
            fn = self._function(name)
            version = fn.resolve(qualifier)
            st = self._stat(fn.name)
            if fn.in_flight >= fn.limit():
                st["throttles"] += 1
                raise ApiError(429, "TooManyRequestsException", "Rate Exceeded.")
            if invocation_type == "DryRun":
                return 204, {}, b""
            fn.in_flight += 1
            st["invocations"] += 1
            pool = self._pool_for(fn, version.spec)
            inv = Invocation(payload or b"{}", fn.arn(qualifier), version.spec.version)
            new_workers = pool.submit(inv)
        for w in new_workers:  # process start-up outside the lock
            w.launch()
        if invocation_type == "Event":  # async: accepted now, runs in the background
            threading.Thread(target=self._await, args=(fn, pool, inv), daemon=True).start()
            return 202, {"x-amzn-RequestId": inv.request_id}, b""
        self._await(fn, pool, inv)
        if self._stop.is_set():  # cut short by our shutdown: not the handler's fault
            self._check_running()
        headers = {"X-Amz-Executed-Version": version.spec.version,
                   "x-amzn-RequestId": inv.request_id}
        if inv.function_error:
            headers["X-Amz-Function-Error"] = inv.function_error
        return 200, headers, inv.body

    def _check_running(self) -> None:
        """A stopping endpoint answers 503, as Lambda does when its service is unavailable, so
        clients retry (an in-flight invocation cut short by a restart is no handler error)."""
        if self._stop.is_set():
            raise ApiError(503, "ServiceException", "the Lambda endpoint is shutting down")

    def _await(self, fn: Function, pool: Pool, inv: Invocation) -> None:
        try:
            if not inv.picked.wait(self.init_timeout_s + pool.spec.timeout_s):
                with self._lock:
                    if not inv.picked.is_set():  # no environment became ready in time
                        pool.queue.remove(inv)
                        raise ApiError(502, "ResourceNotReadyException",
                                       f"no execution environment for {fn.name} became ready")
            left = inv.started + pool.spec.timeout_s - time.monotonic()
            if not inv.done.wait(max(0.0, left)):
                pool.expire(inv)
            inv.done.wait(5.0)
        finally:
            with self._lock:
                fn.in_flight -= 1
                st = self._stat(fn.name)
                st["errors"] += inv.function_error is not None
                st["timeouts"] += inv.timed_out

    def route(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
              headers: Any) -> tuple[int, dict[str, str], bytes]:
        if method == "GET" and path == "/local/health":  # liveness only: names nothing
            return 200, {}, b'{"ok": true}'
        qual = (query.get("Qualifier") or [None])[0]
        if method == "POST" and (m := re.fullmatch(f"/2015-03-31/functions{FN}/invocations", path)):
            return self.invoke(unquote(m["fn"]), qual, body,
                               headers.get("X-Amz-Invocation-Type", "RequestResponse"))
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            raise ApiError(400, "InvalidRequestContentException", "body is not JSON") from None
        if not isinstance(req, dict):
            raise ApiError(400, "InvalidRequestContentException", "body is not a JSON object")
        status, out = self.control(method, path, qual, req)
        data = b"" if out is None else json.dumps(out).encode()
        return status, {}, data


class _ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of connections must not overflow the accept backlog
    lam: LocalLambda

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hung up
            super().handle_error(request, client_address)


class _ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: boto3 reuses pooled connections
    disable_nagle_algorithm = True
    server: _ApiServer

    def log_message(self, *args: Any) -> None:
        pass

    timeout = 60  # socket timeout: a client that stalls mid-request cannot pin a thread forever

    def _read_body(self, path: str) -> bytes:
        """The body, after checking its declared length; nothing is read past the limit."""
        if "Transfer-Encoding" in self.headers:  # boto3 never chunks Lambda requests
            raise ApiError(411, "LengthRequiredException", "Content-Length is required")
        raw = (self.headers.get("Content-Length") or "0").strip()
        if not (raw.isascii() and raw.isdigit()):  # "-1": int() takes it, read() would hang
            raise ApiError(400, "InvalidRequestContentException",
                           "Content-Length must be a non-negative integer")
        size = int(raw)
        limit = MAX_INVOKE_BYTES if path.endswith("/invocations") else MAX_CONTROL_BYTES
        if size > limit:
            raise ApiError(413, "RequestTooLargeException",
                           f"Request must be smaller than {limit} bytes for this operation")
        return self.rfile.read(size)

    def _check_headers(self, open_path: bool) -> None:
        """What needs no body: checked before a byte of it is read."""
        check_host(self.headers.get("Host"))
        if self.headers.get("Origin"):  # a web page: boto3 never sends Origin
            raise ApiError(403, "AccessDeniedException", "cross-origin requests are refused")
        if not open_path and not self.headers.get("Authorization"):
            raise ApiError(403, "MissingAuthenticationTokenException",
                           "Missing Authentication Token")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        open_path = method == "GET" and url.path == "/local/health"  # liveness, names nothing
        lam = self.server.lam
        try:
            try:
                self._check_headers(open_path)
                body = self._read_body(url.path)
            except ApiError:
                self.close_connection = True  # the unread body would be parsed as a request
                raise
            if not open_path:
                verify_sigv4(method, self.path, self.headers, body, lam.credentials, lam.region)
            status, headers, out = lam.route(method, url.path, parse_qs(url.query), body,
                                             self.headers)
        except ApiError as err:
            status, headers = err.status, {"x-amzn-ErrorType": err.code}
            doc = {"Type": "User", "message": err.message, "Message": err.message}
            if err.status == 429:
                doc["Reason"] = "ReservedFunctionConcurrentInvocationLimitExceeded"
            out = json.dumps(doc).encode()
        except Exception:  # noqa: BLE001 - a bug here must not kill the server thread
            # The client learns only that it failed; the traceback goes to the endpoint's log.
            traceback.print_exc(file=sys.stderr)
            status, headers = 500, {"x-amzn-ErrorType": "ServiceException"}
            msg = "An internal error occurred in the local Lambda endpoint."
            out = json.dumps({"Type": "Service", "message": msg, "Message": msg}).encode()
        if self.server.lam._stop.is_set():  # make kept-alive clients reconnect (to a successor)
            self.close_connection = True
            headers["Connection"] = "close"
        self.send_response(status)
        headers.setdefault("x-amzn-RequestId", str(uuid.uuid4()))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


def with_embedded_endpoint(cfg: Any, stack: contextlib.ExitStack) -> Any:
    """Start the local endpoint for a run whose rewards go to Lambda with no endpoint given
    (`reward.embedded_endpoint`); returns the config pointed at it. Stopped with `stack`. Its
    key pair (ROLLART_LAMBDA_* this process holds, else a fresh one) is held by this process
    (rollart.secrets) until `stack` closes."""
    r = cfg.reward
    if r.backend != "lambda" or r.endpoint_url is not None or not r.embedded_endpoint:
        return cfg
    spec = FunctionSpec(r.lambda_name, r.function, concurrency=r.max_concurrency,
                        timeout_s=r.timeout_s, memory_mb=r.memory_mb)
    lam = stack.enter_context(LocalLambda([spec], idle_timeout_s=30,
                                          credentials=LambdaCredentials.from_env()))
    # This process holds its keys (in memory, not in the environment) for the run; the run
    # gives them to the workers that score rewards (rollart.secrets.on_cluster).
    owner = f"embedded-lambda-{lam.port}"
    secrets.hold(lam.credentials.env(), owner=owner)
    stack.callback(secrets.release, owner)
    return cfg.model_copy(update={"reward": r.model_copy(update={"endpoint_url": lam.url})})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9001)
    ap.add_argument("--function", action="append", default=[], metavar="NAME=HANDLER",
                    help="register NAME running HANDLER (reward name or module.function)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    creds = LambdaCredentials.from_env()
    if creds is None:  # fail closed: an endpoint nobody can call, or anybody, helps no one
        sys.exit("infra.lambda_endpoint: set ROLLART_LAMBDA_ACCESS_KEY_ID and "
                 "ROLLART_LAMBDA_SECRET_ACCESS_KEY (the key pair clients sign with)")
    specs = [FunctionSpec(n, h or n, args.concurrency, args.timeout)
             for n, _, h in (f.partition("=") for f in args.function)]
    lam = LocalLambda(specs, port=args.port, idle_timeout_s=args.idle_timeout,
                      default_concurrency=args.concurrency, credentials=creds).start()
    print(f"local Lambda endpoint on {lam.url} (functions: "
          f"{', '.join(s.name for s in specs) or 'none; deploy some'})", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    lam.stop()


if __name__ == "__main__":
    main()
