"""Execution environments of the local Lambda endpoint: the Runtime API side.

A `Worker` is one execution environment: a `python -m awslambdaric module.handler` process (the
real AWS runtime interface client, its memory capped at the function's memory size) plus the
Lambda Runtime API it polls, served on its own loopback port so the endpoint always knows which
process holds which invocation (needed to kill exactly that process on a timeout). A `Pool` is
the set of workers for one function version and its queue of invocations; it scales from zero:
an invocation that finds no idle or starting worker starts one, up to the function's
concurrency limit. Scale-down is the endpoint's reaper.

All state changes happen under one lock shared with the endpoint (`Pool.cond` wraps it).

The Runtime API has no authentication of its own (awslambdaric sends none), and whoever polls a
worker's port gets that worker's invocations and may answer them (any reward it likes). So a
connection is served only when the kernel says its client socket belongs to this process's own
user (`/proc/net/tcp`); another local user's connection is closed unanswered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RUNTIME = "/2018-06-01/runtime"
# What a worker may inherit from the endpoint's environment (never AWS credentials).
PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_HOME",
            "TRANSFORMERS_OFFLINE", "PYTHONPATH")


def loopback_peer_uid(peer: tuple[str, int], server_port: int) -> int | None:
    """The uid owning the client end of a 127.0.0.1 TCP connection to `server_port`, from
    /proc/net/tcp; None where the kernel does not say (no /proc: not Linux)."""
    ip = "".join(f"{int(b):02X}" for b in reversed(peer[0].split(".")))
    want_local, want_remote = f"{ip}:{peer[1]:04X}", f"0100007F:{server_port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[1] == want_local and fields[2] == want_remote:
                    return int(fields[7])
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return None


def cap_memory(pid: int, memory_mb: int) -> None:
    """The function's memory size as the worker's memory limit (RLIMIT_DATA: heap and private
    mappings, what Lambda's limit is about; address space would also count thread stacks and
    reserved arenas), soft == hard so the handler cannot raise it; and no core dumps. Set
    right after the start, while the interpreter is still loading: a handler that allocates
    past it gets MemoryError (the invocation fails, as on Lambda), not the host's memory."""
    import resource

    limit = memory_mb * 1024 * 1024
    try:
        resource.prlimit(pid, resource.RLIMIT_DATA, (limit, limit))
        resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    except ProcessLookupError:  # it died already: its watcher reports that
        pass


def error_body(error_type: str, message: str) -> bytes:
    return json.dumps({"errorMessage": message, "errorType": error_type}).encode()


@dataclass
class Invocation:
    payload: bytes
    arn: str
    version: str
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    picked: threading.Event = field(default_factory=threading.Event)  # a worker took it
    done: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # monotonic time the worker took it
    deadline_ms: int = 0
    worker: Worker | None = None
    body: bytes = b""
    function_error: str | None = None  # "Unhandled" when the function failed
    timed_out: bool = False

    def finish(self, body: bytes, function_error: str | None = None) -> None:
        if not self.done.is_set():
            self.body, self.function_error = body, function_error
            self.picked.set()
            self.done.set()


@dataclass
class VersionSpec:
    """An immutable snapshot of what a worker runs (one function version and code revision)."""

    function: str
    version: str
    handler: str
    timeout_s: float
    memory_mb: int
    env: dict[str, str]
    code_dir: str | None  # None: the endpoint's own project (its import path)
    revision: str = field(default_factory=lambda: uuid.uuid4().hex)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    worker: Worker

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a killed worker hung up
            super().handle_error(request, client_address)


class _RuntimeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the runtime client reuses its connection
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms stall
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet: the endpoint reports metrics instead
        pass

    def handle(self) -> None:
        """Once per connection (the runtime client keeps its one open): our own user only."""
        uid = loopback_peer_uid(self.client_address, self.server.server_address[1])
        if uid is not None and uid != os.getuid():
            self.close_connection = True
            return
        super().handle()

    def _reply(self, status: int, body: bytes = b"{}", headers: dict[str, str] | None = None,
               close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        worker = self.server.worker
        if self.path != f"{RUNTIME}/invocation/next":
            return self._reply(404, error_body("NotFound", self.path))
        inv = worker.pool.next_invocation(worker)
        if inv is None:  # being stopped: the process is killed right after
            return self._reply(410, error_body("ShuttingDown", "worker stopped"), close=True)
        self._reply(200, inv.payload, {
            "Lambda-Runtime-Aws-Request-Id": inv.request_id,
            "Lambda-Runtime-Deadline-Ms": str(inv.deadline_ms),
            "Lambda-Runtime-Invoked-Function-Arn": inv.arn,
            "Lambda-Runtime-Trace-Id": f"Root=1-{inv.request_id[:8]}-{inv.request_id[9:]}",
        })

    def do_POST(self) -> None:
        worker = self.server.worker
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = self.path.removeprefix(RUNTIME).strip("/").split("/")
        if parts == ["init", "error"]:
            worker.pool.init_error(worker, body)
            return self._reply(202, b'{"status":"OK"}')
        if len(parts) == 3 and parts[0] == "invocation" and parts[2] in ("response", "error"):
            failed = parts[2] == "error"
            if worker.pool.complete(worker, parts[1], body, "Unhandled" if failed else None):
                return self._reply(202, b'{"status":"OK"}')
            return self._reply(400, error_body("InvalidRequestID", f"unknown id {parts[1]}"))
        self._reply(404, error_body("NotFound", self.path))


class Worker:
    """One awslambdaric process and the Runtime API it talks to."""

    def __init__(self, pool: Pool, env: dict[str, str], log_path: Path) -> None:
        self.pool, self.env, self.log_path = pool, env, log_path
        self.id = uuid.uuid4().hex[:8]
        self.state = "starting"  # starting -> idle <-> busy -> stopping -> dead
        self.idle_since = time.monotonic()
        self.current: Invocation | None = None
        self.init_error: bytes | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.server = _Server(("127.0.0.1", 0), _RuntimeHandler)
        self.server.worker = self
        self.port = self.server.server_address[1]

    def launch(self) -> None:
        """Start the Runtime API and the process. Called *outside* the lock: 32 Popens take
        ~0.3 s, which would otherwise stall every invocation and the first workers' /next."""
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.25},
                         name=f"runtime-{self.id}", daemon=True).start()
        env = {**self.env, "AWS_LAMBDA_RUNTIME_API": f"127.0.0.1:{self.port}"}
        spec = self.pool.spec
        try:
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "awslambdaric", spec.handler], env=env,
                    cwd=spec.code_dir or os.getcwd(), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            self.init_error = error_body("Runtime.StartError", f"cannot start runtime: {err}")
            self.pool.on_exit(self, -1)
            self._close()
            return
        cap_memory(proc.pid, spec.memory_mb)
        with self.pool.cond:
            self.proc = proc
            if self.state == "stopping":  # stopped while launching
                proc.kill()
        threading.Thread(target=self._watch, name=f"watch-{self.id}", daemon=True).start()

    def _close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _watch(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()  # blocks this thread only; wakes when the process ends
        self.pool.on_exit(self, code)
        self._close()

    def kill(self) -> None:
        """Called under the lock: stop taking work, then SIGKILL (an idle or timed-out env)."""
        self.state = "stopping"
        self.pool.cond.notify_all()
        if self.proc is not None:  # else launch() kills it as soon as it exists
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class Pool:
    """Workers and queued invocations of one function version (one code revision)."""

    def __init__(self, spec: VersionSpec, lock: threading.Lock, limit: Callable[[], int],
                 env: dict[str, str], log_dir: Path, on_spawn: Callable[[Pool], None]) -> None:
        self.spec, self.limit, self.env, self.log_dir = spec, limit, env, log_dir
        self.cond = threading.Condition(lock)
        self.queue: deque[Invocation] = deque()
        self.workers: list[Worker] = []
        self.on_spawn = on_spawn

    def count(self, *states: str) -> int:
        return sum(1 for w in self.workers if w.state in states)

    def live(self) -> int:
        return self.count("starting", "idle", "busy", "stopping")

    def submit(self, inv: Invocation) -> list[Worker]:
        """Under the lock: queue; returns workers to launch (after releasing the lock) when
        nobody idle or starting will take this invocation."""
        self.queue.append(inv)
        self.cond.notify()
        return self.scale()

    def scale(self) -> list[Worker]:
        new: list[Worker] = []
        need = len(self.queue) - self.count("idle", "starting")
        while need > 0 and self.count("starting", "idle", "busy") < self.limit():
            w = Worker(self, self.env, self.log_dir / f"{self.spec.function}-{self.spec.version}"
                       f"-{uuid.uuid4().hex[:6]}.log")
            self.workers.append(w)
            self.on_spawn(self)
            new.append(w)
            need -= 1
        return new

    def next_invocation(self, worker: Worker) -> Invocation | None:
        """The Runtime API's GET /next: block (in bounded waits) until work or stop."""
        with self.cond:
            if worker.state == "starting":
                worker.state, worker.idle_since = "idle", time.monotonic()
            while not self.queue and worker.state == "idle":
                self.cond.wait(1.0)
            if worker.state != "idle":
                return None
            inv = self.queue.popleft()
            worker.state, worker.current, inv.worker = "busy", inv, worker
            inv.started = time.monotonic()
            inv.deadline_ms = int((time.time() + self.spec.timeout_s) * 1000)
            inv.picked.set()
            return inv

    def complete(self, worker: Worker, request_id: str, body: bytes, error: str | None) -> bool:
        with self.cond:
            inv = worker.current
            if inv is None or inv.request_id != request_id:
                return False
            inv.finish(body, error)
            worker.current = None
            if worker.state == "busy":  # it polls /next right after this reply
                worker.state, worker.idle_since = "idle", time.monotonic()
            return True

    def init_error(self, worker: Worker, body: bytes) -> None:
        with self.cond:
            worker.init_error = body

    def expire(self, inv: Invocation) -> None:
        """The function timeout passed: kill the worker, answer like Lambda does."""
        with self.cond:
            if inv.done.is_set():
                return
            inv.timed_out = True
            inv.finish(error_body("Sandbox.Timedout", f"RequestId: {inv.request_id} Error: "
                                  f"Task timed out after {self.spec.timeout_s:.2f} seconds"),
                       "Unhandled")
            if inv.worker is not None:
                inv.worker.current = None
                inv.worker.kill()

    def on_exit(self, worker: Worker, code: int) -> None:
        with self.cond:
            new = self._on_exit(worker, code)
        for w in new:  # replacements for queued work, launched outside the lock
            w.launch()

    def _on_exit(self, worker: Worker, code: int) -> list[Worker]:
        if worker.state == "dead":
            return []
        was = worker.state
        worker.state = "dead"
        self.workers.remove(worker)
        inv = worker.current
        if inv is not None:  # died mid-invocation
            inv.finish(error_body("Runtime.ExitError", f"RequestId: {inv.request_id} "
                                  f"Error: Runtime exited with error: exit status {code}"),
                       "Unhandled")
        elif was == "starting" and self.queue:
            # Init failed: the invocation that caused the cold start gets the error, and a
            # broken function cannot respawn forever (each failure consumes one invocation).
            failed = self.queue.popleft()
            failed.finish(worker.init_error or error_body(
                "Runtime.ExitError", f"Runtime exited during init: exit status {code}"),
                "Unhandled")
        return self.scale()
