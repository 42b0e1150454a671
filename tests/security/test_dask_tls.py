"""Dask with TLS and mutual authentication (infra/dask_tls.py), attacked for real.

The probe in issue 16: a plain `Client` connected to the stack's scheduler and `client.run`
executed code on every worker (which hold the S3 and Lambda keys). Here an attacker process,
with none of the stack's certificates, tries: a plain Client on the `tls://` address, a `tcp://`
Client on the same port, a Client with its own self-signed certificate (`Security.temporary`),
and one with a certificate from another CA of exactly our kind. Each must be refused and the
code it asks every worker to run must not run. The run's own client works. Every worker's HTTP
server (/metrics) listens on loopback only. Both the embedded default (HardwareClassCluster)
and the stack's `dask scheduler` / `dask worker` processes (`rollart up`) are attacked.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client

from infra import dask_tls
from infra.dask_cluster import HardwareClassCluster

ROOT = Path(__file__).resolve().parents[2]

ATTACK = r"""
import json, sys
from pathlib import Path
from distributed import Client, Security

addr, other_ca, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
host_port = addr.split("://", 1)[1]


def pwn(path=str(marker)):  # what the issue's probe ran on every worker
    open(path, "a").write("ran\n")
    return "ran"


def attempt(**kw):
    try:
        with Client(timeout=4, **kw) as c:
            return "CONNECTED:" + repr(c.run(pwn))
    except Exception as err:  # refused: any error before code runs
        return "refused: " + type(err).__name__


other = {"tls_ca_file": f"{other_ca}/ca.pem"}
for role in ("client", "scheduler", "worker"):
    other[f"tls_{role}_cert"] = f"{other_ca}/cert.pem"
    other[f"tls_{role}_key"] = f"{other_ca}/key.pem"
out = {
    "plain": attempt(address=addr),
    "tcp": attempt(address="tcp://" + host_port),
    "self_signed": attempt(address=addr, security=Security.temporary()),
    "other_ca": attempt(address=addr, security=Security(require_encryption=True, **other)),
}
print(json.dumps(out))
"""


def _attack(address: str, tmp: Path) -> dict[str, str]:
    """Run the attacks from a separate process that has no Dask TLS config (as another local
    user would: the stack's certificates are in its private state directory)."""
    other_ca = dask_tls.ensure_certs(tmp / "attacker-ca")
    marker = tmp / "pwned"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DASK_DISTRIBUTED__COMM") and k != "DASK_CONFIG"}
    env["DASK_CONFIG"] = str(tmp / "no-dask-config")  # no user config either
    proc = subprocess.run([sys.executable, "-c", ATTACK, address, str(other_ca), str(marker)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["marker"] = marker.read_text() if marker.exists() else ""
    return out


def _assert_refused(out: dict[str, str]) -> None:
    for name in ("plain", "tcp", "self_signed", "other_ca"):
        assert out[name].startswith("refused"), (name, out[name])
    assert out["marker"] == ""  # no code ran on any worker


def _listening(port: int) -> list[str]:
    """Local addresses (hex, /proc/net/tcp{,6} form) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    found.append(addr)
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def _check_metrics_loopback(client: Client) -> None:
    workers = client.scheduler_info()["workers"]
    assert workers
    for addr, w in workers.items():
        assert addr.startswith("tls://127.0.0.1:"), addr
        port = w["services"]["dashboard"]  # the worker's HTTP server: /metrics, /health
        bound = _listening(port)
        assert bound and set(bound) <= LOOPBACK, (addr, port, bound)


def _legit_run(client: Client) -> None:
    assert client.submit(lambda x: x + 1, 41, pure=False).result(timeout=60) == 42
    assert set(client.run(lambda: "ok").values()) == {"ok"}


def test_embedded_cluster_refuses_clients_without_the_run_certificate(tmp_path):
    with contextlib.ExitStack() as stack:
        sec = dask_tls.embedded(stack)
        assert sec is not None and sec.require_encryption
        certs = Path(sec.tls_ca_file).parent
        assert stat.S_IMODE(certs.stat().st_mode) == 0o700
        assert stat.S_IMODE((certs / "key.pem").stat().st_mode) == 0o600
        cluster = stack.enter_context(HardwareClassCluster(workers={"CPU": 1}, dashboard=False,
                                                           security=sec))
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with Client(cluster.scheduler_address) as client:  # config set by `embedded`
            _legit_run(client)
            _check_metrics_loopback(client)
        _assert_refused(_attack(cluster.scheduler_address, tmp_path))
    assert not certs.exists()  # the run's certificates go with the run


def test_embedded_cluster_without_tls_is_what_the_attack_reaches(tmp_path):
    """The control: the same attacks against a cluster without TLS get in (so the test above
    would fail if TLS were off). `cluster.tls: false` exists only to measure the cost."""
    with contextlib.ExitStack() as stack:
        assert dask_tls.embedded(stack, enabled=False) is None
        cluster = stack.enter_context(HardwareClassCluster(workers={"CPU": 1}, dashboard=False))
        addr = cluster.scheduler_address
        assert addr.startswith("tcp://")
        other_ca = dask_tls.ensure_certs(tmp_path / "attacker-ca")
        marker = tmp_path / "pwned"
        proc = subprocess.run([sys.executable, "-c", ATTACK, addr, str(other_ca), str(marker)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["plain"].startswith("CONNECTED") and marker.exists()


@pytest.fixture
def dask_stack(tmp_path):
    """The stack's scheduler and one worker, started by `Stack` as `rollart up` starts them."""
    from infra.prefect_server import free_port
    from infra.stack import Stack

    s = Stack(tmp_path / "state", classes={"CPU": 1})
    s.state.mkdir(mode=0o700)
    s.ports.update(scheduler=free_port(), dashboard=free_port())
    env = {k: v for k, v in s.child_env().items() if k != "DASK_CONFIG"}
    try:
        s._ensure_dask(env)
        yield s
    finally:
        s.down()


def test_stack_scheduler_and_workers_require_the_stack_certificate(dask_stack, tmp_path):
    s = dask_stack
    addr = s.scheduler_address
    assert addr and addr.startswith("tls://127.0.0.1:")
    certs = dask_tls.stack_cert_dir(s.state)
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in certs.iterdir())
    with contextlib.ExitStack() as stack:
        # what a flow run given the stack's tls:// address does (flows/train.py)
        assert dask_tls.connect_existing(stack, addr, s.state)
        client = stack.enter_context(Client(addr, timeout=60))
        deadline = time.monotonic() + 90
        while not client.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.5)
        _legit_run(client)
        _check_metrics_loopback(client)
    _assert_refused(_attack(addr, tmp_path))
    status = {st.name: st for st in s.status()}
    assert status["dask-scheduler"].url == addr
    assert "TLS" in status["dask-scheduler"].extra["auth"]
