"""The code-execution reward's sandbox, attacked as issue 16's probes did.

Each attack runs twice where that proves something: against the full sandbox, and with the
layer under test still on but the Python audit hook off (`without=("audit",)`: what a solution
that switches the hook off faces), so the kernel layer is shown to hold by itself; a control
with the kernel layer skipped too shows the attack would have worked (the test can fail).
The solution gets `socket` pre-imported (`preload`), as a world-readable Python would give it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart.rewards import code_exec as ce
from rollart.rewards.code_exec import SandboxUnavailable, _run_once, code_exec

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, without: tuple[str, ...] = ("audit",), timeout_s: float = 5.0,
         preload: tuple[str, ...] = ("socket",)) -> dict:
    return _run_once(code, None, "", timeout_s, 256, without=without, preload=preload)


@pytest.fixture
def udp_listener():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(1.5)
    yield s
    s.close()


def _received(s: socket.socket) -> bytes:
    try:
        return s.recvfrom(100)[0]
    except TimeoutError:
        return b""


def test_udp_does_not_leave_the_sandbox(udp_listener):
    port = udp_listener.getsockname()[1]
    code = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"try:\n    s.sendto(b'leak', ('127.0.0.1', {port}))\n    print('sent')\n"
            "except OSError as e:\n    print('blocked', e.errno)\n")
    for without in (("audit",), ()):
        out = _run(code, without)
        assert "sent" not in out["stdout"], (without, out)
        assert _received(udp_listener) == b""
    # control: without the network namespace the datagram arrives (so the check above works)
    allow = {**os.environ, ce.ALLOW_WEAK_ENV: "1"}
    old = os.environ.copy()
    os.environ.update(allow)
    try:
        out = _run(code, ("audit", "namespaces"))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert "sent" in out["stdout"] and _received(udp_listener) == b"leak", out


def test_tcp_to_the_host_refused(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
            "    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n")
    try:
        out = _run(code)
        assert "connected" not in out["stdout"], out
    finally:
        srv.close()


def test_disk_fill_stops_at_the_quota():
    code = ("import os\nn = 0\ntry:\n    for i in range(100000):\n"
            "        with open(f'f{i}', 'wb') as f:\n"
            "            for _ in range(16):\n                f.write(b'x' * 65536)\n"
            "                n += 65536\nexcept OSError as e:\n    print('stopped', e.errno)\n"
            "print('bytes', n)\n")
    out = _run(code, timeout_s=10)
    written = int(out["stdout"].split("bytes")[-1])
    assert 0 < written <= ce.DISK_LIMIT + (1 << 20), out
    assert "stopped" in out["stdout"]
    files = ("import os\nn = 0\ntry:\n    while True:\n        open(f'e{n}', 'w').close()\n"
             "        n += 1\nexcept OSError:\n    pass\nprint('files', n)\n")
    n = int(_run(files)["stdout"].split("files")[-1])
    assert n <= ce.MAX_FILES


def test_files_environment_and_parent_out_of_reach(tmp_path):
    target = tmp_path / "outside"
    tmp_path.chmod(0o777)  # so only the sandbox, not the uid, can stop the write
    probes = {
        "passwd": "print(open('/etc/passwd').read()[:20])",
        "parent_env": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read()[:50])",
        "write": f"open({str(target)!r}, 'w').write('pwned')\nprint('wrote')",
        "signal": "import os\nos.kill(os.getppid(), 0)\nprint('signalled')",
        "fork": "import os\npid = os.fork()\nprint('forked', pid)",
    }
    for name, code in probes.items():
        for without in (("audit",), ()):
            out = _run(code, without)
            assert out["returncode"] != 0 and out["stdout"].strip() == "", (name, out)
    assert not target.exists()


def test_runs_as_nobody_when_started_as_root():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    out = _run("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    assert out["stdout"].split()[:3] == ["65534", "65534", "65534"], out


def test_fail_closed_without_landlock_unless_allowed(monkeypatch):
    monkeypatch.delenv(ce.ALLOW_WEAK_ENV, raising=False)
    for layer, name in (("landlock", "Landlock"), ("namespaces", "namespaces")):
        with pytest.raises(SandboxUnavailable, match=name):
            _run("print('ran')", without=(layer,))
    # through the handler: an error (the run's on_error policy decides), never a score
    monkeypatch.setattr(ce, "_run_once", lambda *a, **k: _run_once(*a, **k,
                                                                  without=("landlock",)))
    with pytest.raises(SandboxUnavailable):
        code_exec({"code": "print(3)", "tests": [{"input": "", "output": "3"}]})
    monkeypatch.setenv(ce.ALLOW_WEAK_ENV, "1")  # the operator's explicit choice
    assert code_exec({"code": "print(3)", "tests": [{"input": "", "output": "3"}]})["reward"] == 1


KILLED_PARENT = r"""
import sys
from rollart.rewards.code_exec import _run_once
_run_once("import time\ntime.sleep(60)", None, "", 30.0, 256)
"""


def _sandboxes() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"sandbox_runner.py" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_sandbox_dies_with_its_caller():
    """A Lambda timeout kills the handler's process (SIGKILL): its sandbox must not live on
    under PID 1 (the probe's sandbox did)."""
    before = set(_sandboxes())
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 30
    mine: set[int] = set()
    while not mine and time.monotonic() < deadline:
        mine = set(_sandboxes()) - before
        time.sleep(0.1)
    assert mine, "the sandbox never started"
    time.sleep(1.0)  # confined and sleeping
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while set(_sandboxes()) & mine and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_sandboxes()) & mine


def test_sandbox_dies_on_the_lambda_timeout():
    """Through the real local Lambda endpoint: a function timeout of 3 s, a solution that sleeps
    and asks for 30 s. The handler caps the run at the Lambda's remaining time, so it answers a
    scored timeout before the endpoint would kill it, and no sandbox is left (the kill itself
    is the test above)."""
    from infra.lambda_endpoint import LocalLambda
    from infra.lambda_functions import FunctionSpec
    from rollart.rewards.client import make_boto3_client

    before = set(_sandboxes())
    spec = FunctionSpec("code", "code_exec", concurrency=1, timeout_s=3.0)
    with LocalLambda([spec], idle_timeout_s=30) as lam:
        c = make_boto3_client(lam.url, "us-east-1", timeout_s=20, max_concurrency=1,
                              credentials=lam.credentials)
        event = {"code": "import time\ntime.sleep(60)", "timeout_s": 30,
                 "tests": [{"input": "", "output": ""}]}
        t0 = time.monotonic()
        r = c.invoke(FunctionName="code", Payload=json.dumps(event).encode())
        out = json.loads(r["Payload"].read())
        assert not r.get("FunctionError") and time.monotonic() - t0 < 10, out
        assert out["reward"] == 0.0 and out["timeout"] == 1.0, out
        time.sleep(1.0)
        assert not set(_sandboxes()) - before


CHEATS = {  # name: (solution, tests it must not pass)
    # the probe: read the pass marker from the runner's frame, print it, exit 0
    "frame_marker": ("import sys, os\nf = sys._getframe()\nwhile f:\n"
                     "    if 'marker' in f.f_locals:\n"
                     "        print(f.f_locals['marker'])\n        sys.stdout.flush()\n"
                     "        os._exit(0)\n    f = f.f_back\n"
                     "def f(x):\n    return 0\n", "assert f(3) == 6\n"),
    "stdin_marker": ("import sys, os\nprint(sys.stdin.read())\nsys.stdout.flush()\n"
                     "os._exit(0)\n", "assert f(3) == 6\n"),
    # the probe: an object whose __eq__ is always true
    "always_equal": ("class Eq:\n    def __eq__(self, other):\n        return True\n"
                     "    __ne__ = lambda self, other: False\n"
                     "def f(x):\n    return Eq()\n", "assert f(3) == 6\n"),
    "shadow_builtin": ("def f(x):\n    return [0]\n"
                       "def sorted(x):\n    return [1, 2]\n",
                       "assert sorted(f(3)) == [1, 2]\n"),
    "early_exit": ("import sys\nsys.exit(0)\ndef f(x): return 6\n", "assert f(3) == 6\n"),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_asserts_mode_cheats_do_not_pass(name):
    code, tests = CHEATS[name]
    out = code_exec({"code": code, "test_code": tests})
    assert out["reward"] == 0.0, (name, out)


def test_asserts_mode_still_tests_real_solutions():
    sol = ("import math\nLIMIT = 10\n"
           "def f(x):\n    return 2 * x\n"
           "def pair(a, b=1):\n    return (a, b, [a + b])\n"
           "def boom():\n    raise ValueError('no')\n"
           "class Counter:\n    def __init__(self, start):\n        self.n = start\n"
           "    def add(self, k):\n        self.n += k\n        return self.n\n")
    tests = ("assert f(3) == 6 and isinstance(f(3), int)\n"
             "assert pair(1, b=2) == (1, 2, [3]) and LIMIT == 10\n"
             "try:\n    boom()\n    raise AssertionError('no error')\n"
             "except ValueError as e:\n    assert str(e) == 'no'\n"
             "c = Counter(5)\nassert c.add(2) == 7 and c.n == 7\n")
    out = code_exec({"code": sol, "test_code": tests})
    assert out["reward"] == 1.0, out
    wrong = code_exec({"code": sol.replace("2 * x", "2 * x + 1"), "test_code": tests})
    assert wrong["reward"] == 0.0
