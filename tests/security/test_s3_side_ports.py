"""The local S3 server answers other local users only through its signed S3 endpoint.

`weed mini`'s master, volume and filer ports (HTTP and gRPC) have no authentication: a user
who can connect to the filer reads, overwrites and deletes any object. `infra/seaweed.py` runs
the server in a network namespace of its own and forwards only the S3 endpoint
(`infra/s3_gateway.py`). Here another local user (`nobody`) tries every port the server listens
on, the way such an attack found them (from the server's own socket table), plus unsigned
requests to the endpoint, and a join of the server's namespace. The control run starts `weed
mini` as it was started before (in the host's network) and shows the same probe reads, writes
and deletes through the filer, so the probe can fail.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from infra.seaweed import GRPC_OFFSET, SOCKET_DIR, _is_weed, start_seaweed, weed_binary

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
KEY = "k" + "0" * 11
CANARY = b"canary-weights-" + os.urandom(8).hex().encode()

# Runs as `nobody` with the system's Python: stdlib only. For each port: can it connect, can it
# read the object through the filer, overwrite it, delete it.
PROBE = r"""
import http.client, json, sys
ports, bucket, key, canary = json.loads(sys.argv[1])
out = {}
def req(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        c.connect()
        # Nothing listens on the port, but the kernel picked it as the source port too: the
        # socket is connected to itself (TCP simultaneous open) and reads its own request back.
        if c.sock.getsockname() == c.sock.getpeername():
            return None, b"self-connect"
        c.request(method, path, body=body)
        r = c.getresponse()
        return r.status, r.read(1 << 20)
    except OSError as e:
        return None, repr(e).encode()
    except http.client.HTTPException as e:  # something answered, not in HTTP
        return -1, repr(e).encode()
    finally:
        c.close()
for p in ports:
    s_get = req(p, "GET", f"/buckets/{bucket}/{key}")
    s_put = req(p, "PUT", f"/buckets/{bucket}/{key}", b"zeros")
    s_del = req(p, "DELETE", f"/buckets/{bucket}/{key}")
    s3_get = req(p, "GET", f"/{bucket}/{key}")
    s3_del = req(p, "DELETE", f"/{bucket}/{key}")
    out[str(p)] = {"connected": s_get[0] is not None,
                   "read": canary.encode() in s_get[1] or canary.encode() in s3_get[1],
                   "statuses": [s_get[0], s_put[0], s_del[0], s3_get[0], s3_del[0]]}
print(json.dumps(out))
"""


def _as_nobody(args: list[str]) -> subprocess.CompletedProcess:
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(args, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"})


def _listening_ports(pid: int) -> set[int]:
    """Every TCP port `pid` listens on, from its own network's socket table (what an attacker
    reads from `/proc`; root reads any process's)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _probe(ports: set[int], bucket: str, key: str) -> dict:
    python = next((p for p in SYSTEM_PYTHONS if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system Python that another user can run")
    proc = _as_nobody([python, "-c", PROBE,
                       json.dumps([sorted(ports), bucket, key, CANARY.decode()])])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _client(endpoint: str, key: str, secret: str):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key,
                        aws_secret_access_key=secret, region_name="us-east-1")


def test_other_users_reach_nothing_but_the_signed_endpoint(tmp_path):
    with start_seaweed(tmp_path / "s3", access_key=KEY) as s3:
        s3c = _client(s3.endpoint_url, s3.access_key, s3.secret_key)
        s3c.put_object(Bucket=s3.bucket, Key="ckpt/model.bin", Body=CANARY)
        inner = _listening_ports(s3.pid)
        # The server's full set of ports (HTTP and gRPC of every component) exists, but in its
        # own network: the host's socket table has none of them from this process.
        assert {s3.ports["filer"], s3.ports["master"], s3.ports["volume"]} <= inner
        found = _probe(inner | {s3.port}, s3.bucket, "ckpt/model.bin")
        assert not any(r["read"] for r in found.values()), found
        # No port took a request (in the host's network the inner ports are closed, or held by
        # something else); the endpoint answers, but refuses unsigned requests.
        for port, r in found.items():
            assert not any(s is not None and 200 <= s < 300 for s in r["statuses"]), (port, r)
            if int(port) == s3.port:
                assert r["connected"] and all(s in (403, 401) for s in r["statuses"]), r
            elif int(port) == s3.ports["filer"]:
                assert not r["connected"], r
        # Nothing was changed or deleted by any attempt.
        assert s3c.get_object(Bucket=s3.bucket, Key="ckpt/model.bin")["Body"].read() == CANARY
        # Nor can that user step into the server's network.
        joined = _as_nobody(["nsenter", f"--net=/proc/{s3.pid}/ns/net", "true"])
        assert joined.returncode != 0
        # weed's unix sockets (one per port, in /tmp, outside any network namespace) are the
        # owner's alone: connecting needs write permission, which nobody else has.
        socks = [p for port in s3.ports.values() for q in (port, port + GRPC_OFFSET)
                 for p in SOCKET_DIR.glob(f"seaweedfs-*-{q}.sock")]
        assert socks and all(p.stat().st_mode & 0o022 == 0 for p in socks), socks


def test_control_a_server_in_the_host_network_is_open_to_the_probe(tmp_path):
    """The same probe against `weed mini` started in the host's network (as before the private
    namespace): it reads, overwrites and deletes the object through the filer."""
    data = tmp_path / "data"
    data.mkdir()
    ports = {"master": 29713, "volume": 29721, "filer": 29738, "s3": 29745, "admin": 29752}
    args = [weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-bucket=ctl", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]
    args += [a for c, p in ports.items() for a in (f"-{c}.port={p}", f"-{c}.port.grpc={p + 10000}")]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": "s" * 20}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        s3c = _client(f"http://127.0.0.1:{ports['s3']}", KEY, "s" * 20)
        deadline = time.monotonic() + 30
        while True:
            try:
                s3c.put_object(Bucket="ctl", Key="ckpt/model.bin", Body=CANARY)
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        assert _is_weed(proc.pid)
        found = _probe(_listening_ports(proc.pid), "ctl", "ckpt/model.bin")
        filer = found[str(ports["filer"])]
        assert filer["read"] and filer["connected"], found
        with pytest.raises(s3c.exceptions.NoSuchKey):  # the filer DELETE went through
            s3c.get_object(Bucket="ctl", Key="ckpt/model.bin")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
