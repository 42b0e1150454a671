"""Code-execution reward: run untrusted (model-written) Python against tests, safely.

Every run is a fresh `python -I sandbox_runner.py` process in its own session and temp dir,
with a clean environment (no AWS credentials or anything else of the caller's), stdin/stdout/
stderr in files (so output is bounded by RLIMIT_FSIZE, never by the caller's memory), and a
wall-clock limit enforced here by killing the whole process group. Inside, the runner sets
rlimits, drops root, applies Landlock and an audit hook (see sandbox_runner.py). A run that loops
forever, allocates without bound, writes outside its temp dir or tries to reach the caller ends
as a scored failure with a flag, never as an exception in the handler.

Two test styles:
- `tests: [{"input": str, "output": str}, ...]`: one run per test, stdin -> stdout compared
  line by line (trailing whitespace ignored); reward = fraction passed.
- `test_code: str`: one run in two sandboxes (sandbox_runner "serve" / "tests"): the tests
  call the solution's top-level functions and classes through a pipe and get plain literals
  back; reward 1.0 if the tests' process exits 0 and printed the completion marker, which the
  solution's process never sees (so neither `sys.exit(0)`, reading the marker, an always-equal
  object nor a redefined builtin passes). Tests exchange literals (numbers, strings, bytes,
  tuples, lists, dicts, sets, None) and opaque handles to other objects.

Fail closed: where the kernel cannot confine the code (no Landlock, no namespaces), the run
raises SandboxUnavailable naming what is missing, unless the operator set
ROLLART_SANDBOX_ALLOW_WEAK=1 (then only rlimits and a Python audit hook, which a solution can
defeat, stand between it and the host).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart.rewards.events import response_of

RUNNER = Path(__file__).with_name("sandbox_runner.py")
MAX_TESTS = 64
MAX_TIMEOUT_S = 30.0
OUTPUT_LIMIT = 1 << 20  # bytes of stdout/stderr a run may write (RLIMIT_FSIZE)
DISK_LIMIT = 32 << 20  # bytes all files of one run may hold (its tmpfs)
MAX_FILES = 256  # inodes of that tmpfs
EXIT_UNCONFINED = 97  # sandbox_runner: the kernel cannot confine the code, nothing ran
# Operator's choice, never a request's: run where only the audit hook (and rlimits) confine the
# code, which a determined solution can switch off. Off by default: fail closed.
ALLOW_WEAK_ENV = "ROLLART_SANDBOX_ALLOW_WEAK"
SANDBOX_UID = 65534  # `nobody`: who the runner becomes when started as root


class SandboxUnavailable(RuntimeError):
    """This host cannot confine untrusted code (the message names the missing layer)."""


def _new_private(path: Path) -> Any:
    """A new file, 0600 from creation (never world-readable, not even for an instant): the
    hidden tests, the solution and their output must not be readable by other local users
    while a run scores them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "wb")


def _write_private(path: Path, text: str) -> None:
    with _new_private(path) as f:
        f.write(text.encode("utf-8"))
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(event: dict[str, Any]) -> str:
    """`code` if given, else the last fenced code block of the response, else the response."""
    if event.get("code") is not None:
        return str(event["code"])
    text = response_of(event)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _run_once(code: str, tests_py: str | None, stdin: str, timeout_s: float,
              memory_mb: int, without: tuple[str, ...] = (),
              preload: tuple[str, ...] = ()) -> dict[str, Any]:
    """One sandboxed run. Returns exit code, bounded stdout/stderr, timed_out, wall seconds.

    Without `tests_py`: one process runs the solution as a program on `stdin`. With it: two
    processes, each in its own sandbox, joined only by two pipes: the solution's serves calls
    of its top-level functions (sandbox_runner "serve"), the tests' runs `tests_py` against
    proxies of them and gets plain Python literals back ("tests"); only the tests' process
    reads `stdin` (the completion marker), and the verdict is its exit status and stdout.
    `without` skips confinement layers and `preload` imports modules before the uid drop
    (tests only: each layer is shown to be needed)."""
    # Two private dirs (0700 from creation): the boxes, which become the sandbox user's, and
    # the caller's own io/ (stdin, stdout, stderr), kept out of the sandbox user's reach.
    base = Path(tempfile.mkdtemp(prefix="rollart-code-"))
    io_dir = Path(tempfile.mkdtemp(prefix="rollart-code-io-"))
    roles = ["solution"] if tests_py is None else ["solution", "tests"]
    procs: dict[str, subprocess.Popen] = {}
    try:
        _write_private(io_dir / "stdin", stdin)
        pipes = (*os.pipe(), *os.pipe()) if tests_py is not None else ()
        # solution reads requests (fd 0 of pipes) and writes answers (fd 3); tests the reverse
        fds = {"solution": pipes[0::3], "tests": pipes[1:3][::-1]} if pipes else {}
        for role in roles:
            box = base / role
            box.mkdir(mode=0o700)
            name = "tests.py" if role == "tests" else "solution.py"
            _write_private(box / name, tests_py if role == "tests" else code)
            if os.geteuid() == 0:  # the runner drops to nobody, which must own its sandbox
                for p in (box, *box.iterdir()):
                    os.chown(p, SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)
        if os.geteuid() == 0:  # nobody must reach its box: the base is nobody's, still 0700
            os.chown(base, SANDBOX_UID, SANDBOX_UID)
        t0 = time.perf_counter()
        for role in roles:
            box = base / role
            mode = "main" if tests_py is None else ("serve" if role == "solution" else "tests")
            limits = {"memory_mb": memory_mb, "cpu_s": int(timeout_s) + 1,
                      "fsize_bytes": OUTPUT_LIMIT, "disk_bytes": DISK_LIMIT,
                      "max_files": MAX_FILES, "parent": os.getpid(), "mode": mode,
                      "fds": list(fds.get(role, ())), "without": list(without),
                      "preload": list(preload),
                      "allow_weak": os.environ.get(ALLOW_WEAK_ENV) == "1"}
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(box),
                   "TMPDIR": str(box), "PYTHONHASHSEED": "0"}
            stdin_path = io_dir / "stdin" if mode != "serve" else Path(os.devnull)
            with open(stdin_path, "rb") as fin, _new_private(io_dir / f"{role}.out") as fout, \
                    _new_private(io_dir / f"{role}.err") as ferr:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-I", str(RUNNER), str(box), json.dumps(limits)],
                    stdin=fin, stdout=fout, stderr=ferr, cwd=box, env=env,
                    start_new_session=True, close_fds=True, pass_fds=fds.get(role, ()))
        for fd in pipes:  # only the two sandboxes hold the pipes: EOF when either dies
            os.close(fd)
        decisive = procs[roles[-1]]
        timed_out = False
        try:
            decisive.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        wall = time.perf_counter() - t0
    finally:  # also on an exception here (the handler being torn down)
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group, not just the leader
                proc.wait(timeout=5)
    try:
        unconfined = [r for r, p in procs.items() if p.returncode == EXIT_UNCONFINED]
        if unconfined:
            err = (io_dir / f"{unconfined[0]}.err").read_text(errors="replace").strip()
            raise SandboxUnavailable(err.splitlines()[-1] if err else
                                     "sandbox: the code could not be confined")

        def tail(name: str) -> str:
            data = (io_dir / name).read_bytes()[:OUTPUT_LIMIT]
            return data.decode("utf-8", errors="replace")

        return {"returncode": decisive.returncode, "stdout": tail(f"{roles[-1]}.out"),
                "stderr": "".join(tail(f"{r}.err") for r in roles), "timed_out": timed_out,
                "wall_s": wall}
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def _flags(run: dict[str, Any]) -> dict[str, float]:
    err = run["stderr"]
    return {
        "timeout": float(run["timed_out"] or run["returncode"] == -signal.SIGXCPU),
        "memory_error": float("MemoryError" in err),
        "sandbox_violation": float("sandbox:" in err or "PermissionError" in err),
        "syntax_error": float("SyntaxError" in err and "solution.py" in err),
    }


def code_exec(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """event: {"code" | "response" | "final_response": str, "tests": [{"input","output"}] |
    "test_code": str, "timeout_s": float = 2 (per run), "memory_mb": int = 256,
    "budget_s": float = 20 (all runs together; tests past it count as failed)}"""
    code = extract_code(event)
    timeout_s = min(max(float(event.get("timeout_s", 2.0)), 0.1), MAX_TIMEOUT_S)
    if context is not None and hasattr(context, "get_remaining_time_in_millis"):
        # never past the Lambda's own deadline (the sandbox also dies with this process)
        timeout_s = min(timeout_s, max(0.1, context.get_remaining_time_in_millis() / 1000 - 0.5))
    memory_mb = min(max(int(event.get("memory_mb", 256)), 64), 4096)
    budget_end = time.monotonic() + float(event.get("budget_s", 20.0))
    flags = {"timeout": 0.0, "memory_error": 0.0, "sandbox_violation": 0.0,
             "syntax_error": 0.0}
    passed, total, wall = 0, 0, 0.0
    if event.get("test_code") is not None:
        total = 1
        marker = secrets.token_hex(16)
        run = _run_once(code, str(event["test_code"]), marker + "\n", timeout_s, memory_mb)
        ok = run["returncode"] == 0 and marker in run["stdout"].splitlines()
        passed, wall = int(ok), run["wall_s"]
        flags = {k: max(v, _flags(run)[k]) for k, v in flags.items()}
    else:
        tests = list(event.get("tests", []))[:MAX_TESTS]
        if not tests:
            raise ValueError("code_exec reward needs `tests` (input/output pairs) or `test_code`")
        total = len(tests)
        for test in tests:
            remaining = budget_end - time.monotonic()
            if remaining <= 0:
                flags["timeout"] = 1.0
                break
            run = _run_once(code, None, str(test.get("input", "")),
                            min(timeout_s, remaining), memory_mb)
            wall += run["wall_s"]
            ok = run["returncode"] == 0 and _same_output(run["stdout"], str(test["output"]))
            passed += int(ok)
            flags = {k: max(v, _flags(run)[k]) for k, v in flags.items()}
    return {"reward": passed / total, "passed": float(passed), "total": float(total),
            "run_s": wall, **flags}
