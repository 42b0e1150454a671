"""The code-execution sandbox started by an unprivileged user (the non-root path).

A reward worker that is not root cannot drop to `nobody`: sandbox_runner confines the code in a
user namespace (its own uid mapped to itself) with private network and mount namespaces, drops
the namespace's capabilities, and relies on Landlock (files, TCP, and ABI 6 signal scoping).
The code runs with the caller's own uid, so ordinary file permissions protect nothing here:
everything below is stopped by the sandbox alone. A control run with the layers switched off
(by the operator's ROLLART_SANDBOX_ALLOW_WEAK) shows each attack would have worked.

The caller runs as a throw-away system user created by the fixture (root is needed for that;
a non-root test process is already the caller we want), with the system's Python, which that
user can read (the venv's interpreter lives under /root). It only needs the standard library
and rollart/rewards.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
CANARY = "canary-" + secrets.token_hex(8)

DRIVER = r"""
import json, os, sys
from rollart.rewards import code_exec as ce

probes = json.loads(sys.argv[1])
out = {"uid": os.getuid()}
for name, p in probes.items():
    if p.get("weak"):
        os.environ[ce.ALLOW_WEAK_ENV] = "1"
    else:
        os.environ.pop(ce.ALLOW_WEAK_ENV, None)
    try:
        if "event" in p:
            out[name] = ce.code_exec(p["event"])
        else:
            out[name] = ce._run_once(p["code"], None, "", p.get("timeout", 5.0),
                                     p.get("memory_mb", 256), without=tuple(p.get("without", ())),
                                     preload=tuple(p.get("preload", ("socket",))))
    except ce.SandboxUnavailable as err:
        out[name] = {"unavailable": str(err)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def caller():
    """(run, user dir): `run(probes)` runs DRIVER as an unprivileged user; the user dir is that
    user's own 0700 directory, outside every sandbox."""
    python = next((p for p in SYSTEM_PYTHONS if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system Python that an unprivileged user can run")
    name, created = None, False
    if os.geteuid() == 0:
        if shutil.which("useradd") is None:
            pytest.skip("root, but no useradd to create an unprivileged user")
        name = "rsbx" + secrets.token_hex(3)
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                        "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
        created = True
    pw = pwd.getpwnam(name) if name else pwd.getpwuid(os.geteuid())
    home = Path(tempfile.mkdtemp(prefix="rollart-sbx-user-"))
    os.chown(home, pw.pw_uid, pw.pw_gid)
    home.chmod(0o700)

    def run(probes: dict) -> dict:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home),
               "TMPDIR": str(home), "PYTHONPATH": str(ROOT), "ROLLART_FAKE_SECRET": CANARY}
        kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []} if created else {}
        proc = subprocess.run([python, "-c", DRIVER, json.dumps(probes)], env=env, cwd=home,
                              capture_output=True, text=True, timeout=240, **kw)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    try:
        # rollart/rewards must be readable by that user (a checkout under /root is not)
        probe = run({})
        assert probe["uid"] == pw.pw_uid != 0
        yield run, home, pw
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if created:
            subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def listeners():
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(1.5)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp.settimeout(1.5)
    yield udp, tcp
    udp.close()
    tcp.close()


def _received(udp: socket.socket) -> bytes:
    try:
        return udp.recvfrom(100)[0]
    except TimeoutError:
        return b""


def _accepted(tcp: socket.socket) -> bool:
    try:
        tcp.accept()[0].close()
        return True
    except TimeoutError:
        return False


def _attacks(home: Path, udp_port: int, tcp_port: int) -> dict[str, str]:
    secret_file, target = home / "private.txt", home / "outside.txt"
    return {
        "udp": ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"s.sendto(b'leak', ('127.0.0.1', {udp_port}))\nprint('sent')\n"),
        "tcp": (f"import socket\nsocket.create_connection(('127.0.0.1', {tcp_port}), 2)\n"
                "print('connected')\n"),
        "read_own_file": f"print(open({str(secret_file)!r}).read())",
        "parent_env": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
        "write_outside": f"open({str(target)!r}, 'w').write('pwned')\nprint('wrote')",
        "signal_parent": "import os\nos.kill(os.getppid(), 0)\nprint('signalled')",
    }


def _unavailable_reason(out: dict) -> str | None:
    return out.get("unavailable") if isinstance(out, dict) else None


def test_nonroot_sandbox_confines_as_the_callers_own_uid(caller, listeners):
    run, home, pw = caller
    udp, tcp = listeners
    (home / "private.txt").write_text(CANARY)
    os.chown(home / "private.txt", pw.pw_uid, pw.pw_gid)
    attacks = _attacks(home, udp.getsockname()[1], tcp.getsockname()[1])
    probes: dict[str, dict] = {
        "who": {"code": "import os\nprint(os.getuid(), os.geteuid())"},
        # a raw socket needs CAP_NET_RAW in the sandbox's own network namespace, which the user
        # namespace granted: refused once the capabilities are dropped
        "raw_socket": {"code": ("import socket\ntry:\n    socket.socket(socket.AF_INET, "
                                "socket.SOCK_RAW, socket.IPPROTO_ICMP)\n    print('raw')\n"
                                "except OSError as e:\n    print('refused', e.errno)"),
                       "without": ["audit"]},
    }
    for name, code in attacks.items():
        probes[name] = {"code": code}
        probes[name + "/no_audit"] = {"code": code, "without": ["audit"]}
    probes |= {
        "fork": {"code": "import os\nprint('forked', os.fork())", "without": ["audit"]},
        "memory": {"code": "x = bytearray(1 << 30)\nprint('allocated')", "without": ["audit"]},
        "cpu": {"code": "while True:\n    pass", "timeout": 2.0},
        "disk": {"code": ("n = 0\ntry:\n    for i in range(100000):\n"
                          "        with open(f'f{i}', 'wb') as f:\n"
                          "            for _ in range(16):\n"
                          "                f.write(b'x' * 65536)\n                n += 65536\n"
                          "except OSError as e:\n    print('stopped', e.errno)\nprint('bytes', n)"),
                 "timeout": 10.0},
        "scored": {"event": {"code": "print(int(input()) * 2)",
                             "tests": [{"input": "3", "output": "6"}]}},
        "asserts": {"event": {"code": "def f(x):\n    return 2 * x\n",
                              "test_code": "assert f(3) == 6\n"}},
        "always_equal": {"event": {"code": ("class Eq:\n    def __eq__(self, o):\n"
                                            "        return True\ndef f(x):\n    return Eq()\n"),
                                   "test_code": "assert f(3) == 6\n"}},
    }
    out = run(probes)
    if (why := _unavailable_reason(out["who"])) is not None:
        # The kernel cannot confine an unprivileged caller here: failing closed is the whole
        # behaviour, and nothing ran. (Not a pass of the confinement tests: skipped.)
        assert "missing" in why, why
        pytest.skip(f"this kernel cannot sandbox a non-root caller (it fails closed): {why}")

    uid, euid = out["who"]["stdout"].split()
    assert int(uid) == int(euid) == pw.pw_uid, out["who"]  # no drop to nobody: its own uid
    assert out["raw_socket"]["stdout"].split() == ["refused", "1"], out["raw_socket"]  # EPERM
    for name in attacks:
        for key in (name, name + "/no_audit"):
            r = out[key]
            assert r["returncode"] != 0, (key, r)
            assert not ({"sent", "connected", "wrote", "signalled"} & set(r["stdout"].split()))
            assert CANARY not in r["stdout"], key
    assert _received(udp) == b"" and not _accepted(tcp)
    assert not (home / "outside.txt").exists()
    assert out["fork"]["returncode"] != 0 and "forked" not in out["fork"]["stdout"]
    assert out["memory"]["returncode"] != 0 and "allocated" not in out["memory"]["stdout"]
    assert "MemoryError" in out["memory"]["stderr"]
    assert out["cpu"]["timed_out"] and out["cpu"]["wall_s"] < 8
    written = int(out["disk"]["stdout"].split("bytes")[-1])
    assert "stopped" in out["disk"]["stdout"] and 0 < written <= (33 << 20), out["disk"]
    assert out["scored"]["reward"] == 1.0 and out["asserts"]["reward"] == 1.0
    assert out["always_equal"]["reward"] == 0.0
    assert not list(Path(home).glob("rollart-code-*"))  # every run's temp dir removed


def test_nonroot_control_without_the_layers_the_attacks_work(caller, listeners):
    """The same uid, the operator's weak mode and every layer skipped: the datagram arrives,
    the connection is made, the user's own file is read and written. So the test above fails
    if the sandbox stops confining (the uid itself protects nothing)."""
    run, home, pw = caller
    udp, tcp = listeners
    (home / "private.txt").write_text(CANARY)
    os.chown(home / "private.txt", pw.pw_uid, pw.pw_gid)
    attacks = _attacks(home, udp.getsockname()[1], tcp.getsockname()[1])
    off = ["audit", "namespaces", "landlock"]
    out = run({k: {"code": attacks[k], "without": off, "weak": True}
               for k in ("udp", "tcp", "read_own_file", "write_outside")})
    assert "sent" in out["udp"]["stdout"] and _received(udp) == b"leak"
    assert "connected" in out["tcp"]["stdout"] and _accepted(tcp)
    assert CANARY in out["read_own_file"]["stdout"]
    assert (home / "outside.txt").read_text() == "pwned"


def test_nonroot_fails_closed_when_a_layer_is_missing(caller):
    run, home, _ = caller
    out = run({
        "no_landlock": {"code": "print('ran')", "without": ["landlock"]},
        "no_namespaces": {"code": "print('ran')", "without": ["namespaces"]},
    })
    assert "Landlock" in out["no_landlock"]["unavailable"]
    assert "namespaces" in out["no_namespaces"]["unavailable"]
    assert not list(home.glob("rollart-code-*"))
