"""The local stack behind `rollart up / down / status`: every service a deployment run needs.

    prefect-server   standalone Prefect server (SQLite), reused from infra/prefect_server.py
    prefect-worker   a process worker polling the work pool `rollart-local` (runs deployments;
                     infra/prefect_worker.py: checks each run's job variables and code first)
    dask-scheduler   `dask scheduler` with its dashboard
    dask-<CLASS>-<i> `dask worker --resources CLASS=1`, one process per worker of each class
    lambda           the local Lambda endpoint (`python -m infra.lambda_endpoint`)
    s3               SeaweedFS S3 (`infra/seaweed.py`), when that module exists

Everything listens on 127.0.0.1. Each service has `<name>.pid` and `<name>.log` under one state
directory (`.rollart/` or $ROLLART_STATE_DIR); `stack.json` records ports and settings so a
second `up` reuses what is running (idempotent) and `down` stops exactly what `up` started, by
PID (each process leads its own session, so its children go with it).

The state directory is private (0700, files 0600, children under umask 077; infra/state.py)
before any secret is written to it. The Lambda endpoint accepts only requests signed with the
stack's Lambda key pair (`lambda-credentials.json`), which the `local` rewards block holds (in
the prefect-aws block `aws-credentials/local-lambda`, blocks/registration.py); the
Dask processes get no secret in their environment (a run hands each worker what its class
needs, rollart/secrets.py); the Prefect API only basic auth with `prefect-auth`; Dask only TLS
clients with a certificate from the stack's CA (`dask-tls/`, infra/dask_tls.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from infra.prefect_server import (
    auth_string,
    basic_auth_header,
    free_port,
    healthy,
    locked_job_template,
    ours,
    runs_from,
)
from infra.procs import (
    alive,
    bin_path,
    http_json,
    http_ok,
    port_free,
    port_holder,
    serves_port,
    start_prefect,
    stop_pid,
    stop_pids,
)
from infra.state import (
    PRIVATE_UMASK,
    append_private,
    lambda_credentials,
    private_dir,
    write_private,
)
from rollart.config.hardware import default_workers
from rollart.secrets import SECRET_VARS

if TYPE_CHECKING:
    from rollart.rewards.client import LambdaCredentials

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POOL = "rollart-local"
WORKER_TOKEN = "infra.prefect_worker"  # the worker's module: refuses runs that break the rules
LAMBDA_FUNCTIONS = {"rollart-env-outcome": "env_outcome"}  # Lambda name -> reward handler
LAMBDA_CREDENTIALS_NOTE = "<state dir>/lambda-credentials.json"
DASK_AUTH = "TLS, mutual: a certificate from the stack's CA (<state dir>/dask-tls)"
PREFECT_AUTH = "HTTP basic, <state dir>/prefect-auth"
S3_AUTH = ("S3 SigV4, key pair in <state dir>/seaweed; no other port of the server is "
           "reachable (its own network namespace)")
DEFAULT_PORTS = {"prefect": 4200, "scheduler": 8786, "dashboard": 8787, "lambda": 9001}
# Which service listens on which of its recorded ports (what `status` checks is really ours).
PORT_OWNER = {"scheduler": "dask-scheduler", "dashboard": "dask-scheduler", "lambda": "lambda"}


def default_port(key: str) -> int:
    """A service's default port, or $ROLLART_<KEY>_PORT (e.g. ROLLART_PREFECT_PORT)."""
    return int(os.environ.get(f"ROLLART_{key.upper()}_PORT") or DEFAULT_PORTS[key])


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """`env` less the S3 and Lambda keys (rollart.secrets.SECRET_VARS)."""
    return {k: v for k, v in env.items() if k not in SECRET_VARS}


def default_state_dir() -> Path:
    return Path(os.environ.get("ROLLART_STATE_DIR", ".rollart"))


@dataclass
class ServiceStatus:
    name: str
    up: bool
    pid: int | None = None
    url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Stack:
    """Start, stop and report the local stack under one state directory."""

    def __init__(self, state_dir: Path | str | None = None, *, free_ports: bool = False,
                 classes: dict[str, int] | None = None, pool: str = DEFAULT_POOL,
                 poll_seconds: float = 5.0, worker_limit: int = 2) -> None:
        self.state = Path(state_dir or default_state_dir()).absolute()
        self.file = self.state / "stack.json"
        saved = self._load()
        self.free_ports = free_ports
        self.classes = classes or saved.get("classes") or default_workers()
        self.pool = saved.get("pool", pool) if pool == DEFAULT_POOL else pool
        self.poll_seconds = poll_seconds
        self.worker_limit = worker_limit
        self.ports: dict[str, int] = dict(saved.get("ports", {}))
        self.services: dict[str, dict[str, Any]] = dict(saved.get("services", {}))
        self.notes: list[str] = []  # one line each: what `up` decided that a user should know

    # ---- state -----------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        try:
            return json.loads(self.file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _save(self) -> None:
        private_dir(self.state)
        data = {"classes": self.classes, "pool": self.pool, "ports": self.ports,
                "services": self.services}
        write_private(self.file, json.dumps(data, indent=2, sort_keys=True))

    def lambda_credentials(self, create: bool = False) -> LambdaCredentials | None:
        """The key pair the stack's Lambda endpoint accepts (None before the first `up`)."""
        return lambda_credentials(self.state, create=create)

    def _pick_port(self, key: str) -> int:
        """The service's last port if free, else its default if free, else a free one (said in
        one line of `notes`, naming who holds the default)."""
        old = self.ports.get(key)
        if old and port_free(old):
            return old
        default = default_port(key)
        if not self.free_ports and port_free(default):
            return default
        port = free_port()
        if not self.free_ports:
            self.notes.append(f"{key}: port {default} is held by "
                              f"{port_holder(default) or 'another process'}; using {port}")
        return port

    @property
    def worker_names(self) -> list[str]:
        return [f"{c}-{i}" for c, n in self.classes.items() for i in range(n)]

    # ---- URLs ------------------------------------------------------------------------------
    def prefect_port(self) -> int | None:
        f = self.state / "prefect.port"
        return int(f.read_text()) if f.exists() else None

    @property
    def api_url(self) -> str | None:
        port = self.prefect_port()
        return f"http://127.0.0.1:{port}/api" if port else None

    @property
    def ui_url(self) -> str | None:
        port = self.prefect_port()
        return f"http://127.0.0.1:{port}" if port else None

    @property
    def scheduler_address(self) -> str | None:
        p = self.ports.get("scheduler")
        return f"tls://127.0.0.1:{p}" if p else None  # TLS, mutual auth (infra/dask_tls.py)

    @property
    def dashboard_url(self) -> str | None:
        p = self.ports.get("dashboard")
        return f"http://127.0.0.1:{p}/status" if p else None

    @property
    def lambda_url(self) -> str | None:
        p = self.ports.get("lambda")
        return f"http://127.0.0.1:{p}" if p else None

    # ---- processes -------------------------------------------------------------------------
    def _pid(self, name: str) -> int | None:
        f = self.state / f"{name}.pid"
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return None

    def running(self, name: str) -> bool:
        token = self.services.get(name, {}).get("token")
        return alive(self._pid(name), token)

    def serving(self, name: str) -> bool:
        """Running *and* the one listening on each port recorded for it: a pid that is alive
        but lost its port (or never got it) is not the service."""
        keys = [k for k, svc in PORT_OWNER.items() if svc == name]
        return self.running(name) and all(serves_port(self._pid(name), self.ports.get(k))
                                           for k in keys)

    def prefect_up(self) -> bool:
        """Our Prefect server: its recorded pid listening on its recorded port, healthy."""
        api = ours(self.state)
        return api is not None and api == self.api_url and healthy(api, timeout=2.0)

    def _spawn(self, name: str, cmd: list[str], token: str, env: dict[str, str]) -> int:
        log = append_private(self.state / f"{name}.log")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=PROJECT_ROOT, start_new_session=True,
                                umask=PRIVATE_UMASK)
        log.close()
        write_private(self.state / f"{name}.pid", str(proc.pid))
        self.services[name] = {"token": token, "cmd": cmd}
        return proc.pid

    def _stop(self, name: str) -> bool:
        pid = self._pid(name)
        was = self.running(name)
        if was and pid:
            stop_pid(pid)
        (self.state / f"{name}.pid").unlink(missing_ok=True)
        self.services.pop(name, None)
        return was

    def child_env(self) -> dict[str, str]:
        """Environment of every stack process: our Prefect server, our state, one thread each."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({
            "ROLLART_STATE_DIR": str(self.state),
            "PREFECT_HOME": str(self.state / "prefect-home"),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "DASK_LOGGING__DISTRIBUTED": "warning",
        })
        if self.api_url:
            env["PREFECT_API_URL"] = self.api_url
        auth = auth_string(self.state, create=False)  # the server's basic auth (prefect_server)
        if auth:
            env["PREFECT_API_AUTH_STRING"] = auth
        return env

    def _prefect_json(self, path: str, body: Any = None, method: str | None = None) -> Any:
        auth = basic_auth_header(auth_string(self.state, create=False))
        return http_json(f"{self.api_url}{path}", body, headers=auth, method=method)

    # ---- up --------------------------------------------------------------------------------
    def up(self, timeout: float = 120.0) -> list[ServiceStatus]:
        private_dir(self.state)  # first: every secret below is written into it
        creds = self.lambda_credentials(create=True)
        auth_string(self.state)  # the Prefect server's basic auth, before anything uses it
        assert creds is not None
        for key in ("scheduler", "dashboard", "lambda"):
            if not self.serving(PORT_OWNER[key]):
                self.ports[key] = self._pick_port(key)
        if self.prefect_up():
            self.ports["prefect"] = self.prefect_port() or 0
        else:  # never the recorded port when someone else holds it now
            self.ports["prefect"] = self._pick_port("prefect")
        self._save()
        env = {**self.child_env(), "PREFECT_API_URL": f"http://127.0.0.1:{self.ports['prefect']}/api"}

        # Launch what does not need the Prefect server, then the server, then the worker.
        self._ensure_s3()
        # Dask processes: no secret in their environment (_ensure_dask). The endpoint verifies
        # with the Lambda pair and needs nothing else.
        self._ensure_dask(env)
        self._ensure_lambda({**without_secrets(env), **creds.env()})
        self._save()
        server = start_prefect(self.state, self.ports["prefect"], timeout)
        self.ports["prefect"] = int(server.api_url.rsplit(":", 1)[1].split("/")[0])
        self._ensure_pool_and_worker(self.child_env())
        self._save()
        self._wait_healthy(timeout)
        return self.status()

    def _ensure_dask(self, env: dict[str, str]) -> None:
        from infra.dask_tls import stack_dask_config_dir  # TLS certificates, nanny environ

        # No secret, not even one this shell exports: a run hands each worker the keys its
        # class needs (rollart.secrets.on_cluster) and takes them back when it ends.
        dask_env = {**without_secrets(env), "DASK_CONFIG": str(stack_dask_config_dir(self.state))}
        if not self.serving("dask-scheduler"):
            self._stop("dask-scheduler")  # alive without its ports: not a scheduler of ours
            self._spawn("dask-scheduler", [
                bin_path("dask"), "scheduler", "--host", "127.0.0.1", "--protocol", "tls",
                "--port", str(self.ports["scheduler"]),
                "--dashboard-address", f"127.0.0.1:{self.ports['dashboard']}",
            ], token="scheduler", env=dask_env)
        for name in self.worker_names:
            svc = f"dask-{name}"
            if self.running(svc):
                continue
            hw = name.rsplit("-", 1)[0]
            self._spawn(svc, [
                bin_path("dask"), "worker", self.scheduler_address or "", "--name", name,
                "--nthreads", "1", "--resources", f"{hw}=1", "--memory-limit", "0",
                "--host", "127.0.0.1", "--no-dashboard", "--dashboard-address", "127.0.0.1:0",
                "--local-directory", str(self.state / "dask-workers"),
            ], token=f"--name {name}", env=dask_env)

    def _ensure_lambda(self, env: dict[str, str]) -> None:
        if self.serving("lambda"):
            return
        self._stop("lambda")  # alive without its port: replace it
        cmd = [sys.executable, "-m", "infra.lambda_endpoint", "--port", str(self.ports["lambda"]),
               "--concurrency", "4", "--idle-timeout", "120"]
        for fn, handler in LAMBDA_FUNCTIONS.items():
            cmd += ["--function", f"{fn}={handler}"]
        self._spawn("lambda", cmd, token="infra.lambda_endpoint", env=env)

    def s3(self) -> Any:
        """The stack's SeaweedFS handle (endpoint, bucket, credentials), or None."""
        try:
            from infra import seaweed
        except ImportError:
            return None
        return seaweed.load_running(self.state)

    def _ensure_s3(self) -> None:
        """Start (or reuse) `weed mini` (infra/seaweed.py, state in <state>/seaweed). Its key
        pair goes into the prefect-aws blocks `aws-credentials/local-s3` and `s3-bucket/local`
        (`rollart up`, `rollart deploy`), which the `local` storage block references; a run's
        flow process reads it there and hands it to the workers whose stages use the store."""
        try:
            from infra import seaweed
        except ImportError:  # no local S3 in this checkout: runs store on local disk
            return
        h = seaweed.ensure_running(self.state)
        write_private(self.state / "s3.pid", str(h.pid))
        self.services["s3"] = {"token": "weed", "url": h.endpoint_url, "bucket": h.bucket}
        # The endpoint's forwarder into the server's private network (infra/s3_gateway.py)
        write_private(self.state / "s3-gateway.pid", str(h.gateway_pid))
        self.services["s3-gateway"] = {"token": "infra.s3_gateway", "url": h.endpoint_url}

    def _ensure_pool_and_worker(self, env: dict[str, str]) -> None:
        template = locked_job_template()  # no command / env / working_dir from a flow run
        try:
            pool = self._prefect_json(f"/work_pools/{self.pool}")
            if pool.get("base_job_template") != template:  # a stack from before the lock
                self._prefect_json(f"/work_pools/{self.pool}",
                                   {"base_job_template": template}, method="PATCH")
        except urllib.error.HTTPError as err:
            if err.code != 404:
                raise
            self._prefect_json("/work_pools/", {
                "name": self.pool, "type": "process",
                "description": "rollart local stack: flow runs as processes on this machine",
                "base_job_template": template,
            })
        worker = self.services.get("prefect-worker", {})
        if worker.get("token") != WORKER_TOKEN or worker.get("api") != self.api_url:
            # a stock `prefect worker` from before the checks, or one still polling a server
            # that is no longer ours (it would send our auth string to whoever has that port)
            self._stop("prefect-worker")
        if not self.running("prefect-worker"):  # checks each run first (infra/prefect_worker)
            self._spawn("prefect-worker", [
                sys.executable, "-m", WORKER_TOKEN, "--pool", self.pool,
                "--name", f"{self.pool}-worker", "--limit", str(self.worker_limit),
            ], token=WORKER_TOKEN,
                env={**env, "PREFECT_WORKER_QUERY_SECONDS": str(self.poll_seconds)})
            self.services["prefect-worker"]["api"] = self.api_url

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending: list[str] = []
        while time.monotonic() < deadline:
            st = self.status()
            pending = [s.name for s in st if not s.up and s.name in self.services]
            dead = [n for n in pending if not self.running(n)]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start; see "
                                   + ", ".join(str(self.state / f"{n}.log") for n in dead))
            if not pending:
                return
            time.sleep(0.5)
        raise TimeoutError(f"not healthy after {timeout:.0f}s: {', '.join(pending)} "
                           f"(logs in {self.state})")

    # ---- status ----------------------------------------------------------------------------
    def _workers_seen(self) -> dict[str, dict[str, Any]]:
        p = self.ports.get("dashboard")
        try:
            ident = http_json(f"http://127.0.0.1:{p}/json/identity.json", timeout=2.0)
        except (OSError, ValueError):
            return {}
        return {w.get("name"): {**w, "address": addr}
                for addr, w in ident.get("workers", {}).items()}

    def _prefect_worker_online(self) -> bool:
        try:
            rows = self._prefect_json(f"/work_pools/{self.pool}/workers/filter", {})
        except (OSError, ValueError):
            return False
        return any(w.get("status") == "ONLINE" for w in rows or [])

    def status(self) -> list[ServiceStatus]:
        out: list[ServiceStatus] = []
        api = self.api_url
        up = self.prefect_up()  # ours: the recorded pid serves the recorded port
        out.append(ServiceStatus("prefect-server", up, self._pid("prefect"), self.ui_url,
                                 {"api": api, "ui": self.ui_url, "auth": PREFECT_AUTH}))
        wup = up and self.running("prefect-worker") and self._prefect_worker_online()
        out.append(ServiceStatus("prefect-worker", wup, self._pid("prefect-worker"),
                                 f"{self.ui_url}/work-pools/work-pool/{self.pool}" if up else None,
                                 {"pool": self.pool, "type": "process"}))
        sched_up = self.serving("dask-scheduler") and http_ok(
            f"http://127.0.0.1:{self.ports.get('dashboard')}/health")
        out.append(ServiceStatus("dask-scheduler", sched_up, self._pid("dask-scheduler"),
                                 self.scheduler_address,
                                 {"dashboard": self.dashboard_url, "auth": DASK_AUTH}))
        seen = self._workers_seen() if sched_up else {}
        for name in self.worker_names:
            svc = f"dask-{name}"
            info = seen.get(name, {})
            out.append(ServiceStatus(svc, self.running(svc) and bool(info), self._pid(svc),
                                     info.get("address"),
                                     {"resources": info.get("resources", {})}))
        lam_up = self.serving("lambda") and http_ok(f"{self.lambda_url}/local/health")
        out.append(ServiceStatus("lambda", lam_up, self._pid("lambda"), self.lambda_url,
                                 {"functions": sorted(LAMBDA_FUNCTIONS),
                                  "auth": f"SigV4, key pair in {LAMBDA_CREDENTIALS_NOTE}"}))
        if "s3" in self.services:
            info = self.services["s3"]
            # Up only with its gateway: the endpoint is the forwarder into its private network
            port = urlsplit(info.get("url") or "").port
            up = self.running("s3") and self.running("s3-gateway") and \
                serves_port(self._pid("s3-gateway"), port)
            out.append(ServiceStatus("s3", up, self._pid("s3"), info.get("url"),
                                     {"bucket": info.get("bucket"), "auth": S3_AUTH,
                                      "gateway_pid": self._pid("s3-gateway")}))
        return out

    def status_json(self) -> dict[str, Any]:
        return {"state_dir": str(self.state), "api_url": self.api_url, "ui_url": self.ui_url,
                "scheduler_address": self.scheduler_address,
                "dashboard_url": self.dashboard_url, "lambda_url": self.lambda_url,
                "s3_url": self.services.get("s3", {}).get("url"),
                "pool": self.pool, "classes": self.classes,
                "services": [asdict(s) for s in self.status()]}

    # ---- down ------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Stop the worker first (no new flow runs), then everything else at once."""
        stopped = [n for n in ["prefect-worker"] if self._stop(n)]
        names = [*(f"dask-{n}" for n in self.worker_names), "dask-scheduler", "lambda", "s3",
                 "s3-gateway"]
        live = {n: self._pid(n) for n in names if self.running(n)}
        pid = self._pid("prefect")
        if pid and alive(pid, "prefect") and runs_from(pid, self.state):  # never another's
            live["prefect-server"] = pid
        stop_pids([p for p in live.values() if p])
        for name in [*names, "prefect"]:
            (self.state / f"{name}.pid").unlink(missing_ok=True)
        stopped += list(live)
        self.services.clear()
        if self.state.exists():
            self._save()
        return stopped
