"""The chaos benchmark's outside services and how it watches them (benchmarks/chaos.py).

- `Watch`: a loopback TCP forwarder in front of a service. The run's clients connect to it; it
  records each connection it could or could not open to the service behind it, so a restart's
  `detected` (the first call that found the service down) and `recovered` (the first call that
  reached it again) are the run's own view, measured without touching the run's code.
- `Endpoint`: the local Lambda endpoint (`python -m infra.lambda_endpoint`) as its own process,
  stopped (SIGTERM) and started again on the same port as a cluster manager would.
- `kill_worker` / `holders`: kill -9 of a Dask worker process (its nanny starts a fresh one)
  and which workers hold the actors whose keys start with a prefix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Watch:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream`; records (time, reached) per
    connection the run opened."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.events: list[tuple[float, bool]] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"watch-{upstream}").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            with self.lock:
                self.events.append((time.time(), False))
            conn.close()
            return
        with self.lock:
            self.events.append((time.time(), True))
        up.settimeout(None)
        threading.Thread(target=_pump, args=(up, conn), daemon=True).start()
        _pump(conn, up)

    def first(self, after: float, reached: bool) -> float | None:
        with self.lock:
            return next((t for t, ok in self.events if t >= after and ok == reached), None)

    def count(self, after: float, until: float, reached: bool) -> int:
        with self.lock:
            return sum(1 for t, ok in self.events if after <= t <= until and ok == reached)

    def close(self) -> None:
        self.closed = True
        self.server.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:  # one side gone: close both (the other pump ends on its closed socket)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class Endpoint:
    """The local Lambda endpoint process serving `function` under the same name."""

    def __init__(self, port: int, function: str, env: dict[str, str], log: Path) -> None:
        self.port, self.function, self.env, self.log = port, function, env, log
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Endpoint:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "infra.lambda_endpoint", "--port", str(self.port),
                 "--function", f"{self.function}={self.function}", "--concurrency", "4",
                 "--timeout", "60"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, **self.env})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # printed once it listens
        if "local Lambda endpoint on" not in line:
            raise RuntimeError(f"the Lambda endpoint did not start: {line!r} (see {self.log})")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def holders(client: Any, prefix: str, skip: str | None = None) -> dict[str, list[str]]:
    """Worker address -> keys of the actors it holds that start with `prefix` (`skip`: a
    worker not to ask, e.g. one under SIGSTOP)."""
    workers = [w for w in client.scheduler_info()["workers"] if w != skip]
    actors = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors],
                        workers=workers, on_error="ignore")  # a worker just killed: skipped
    return {a: [k for k in keys if k.startswith(prefix)] for a, keys in actors.items()
            if any(k.startswith(prefix) for k in keys)}


def worker_pid(client: Any, worker: str) -> int:
    return int(client.run(os.getpid, workers=[worker])[worker])


def kill_worker(client: Any, worker: str) -> int:
    """kill -9 of the worker process (not its nanny, which starts a fresh one)."""
    pid = worker_pid(client, worker)
    os.kill(pid, signal.SIGKILL)
    return pid
