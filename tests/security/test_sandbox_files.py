"""Who can read a code_exec run's files while it scores (the hidden tests, the solution, stdin).

A reward worker often runs as root, on a host other users share. While a run scores, its
sandbox directories must be 0700 and owned by the sandbox's user (`nobody` when started as
root; the caller otherwise), every file in them 0600, and the caller's own stdin/stdout/stderr
in a separate 0700 directory. A throw-away system user (made here, as the nonroot sandbox test
does) tries to list and read them mid-run: every attempt is refused.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rollart.rewards import code_exec as ce

SECRET_TEST = "assert solve(2) == 4  # hidden-" + secrets.token_hex(6)
SLOW_SOLUTION = "import time\ntime.sleep(3)\ndef solve(x):\n    return x * 2\n"


@pytest.fixture(scope="module")
def other_user():
    """A fresh system user with no relation to the scoring process."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to act as another local user")
    name = "rsbf" + secrets.token_hex(3)
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as(user: pwd.struct_passwd, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                          capture_output=True, text=True, timeout=30)


def _tree(root: Path) -> list[tuple[Path, os.stat_result]]:
    return [(p, p.lstat()) for p in (root, *sorted(root.rglob("*")))]


def test_scoring_files_are_private_while_a_run_scores(other_user, monkeypatch):
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def spy(*args: object, **kwargs: object) -> str:
        path = real_mkdtemp(*args, **kwargs)  # type: ignore[arg-type]
        made.append(Path(path))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    result: dict = {}
    run = threading.Thread(target=lambda: result.update(ce._run_once(
        SLOW_SOLUTION, SECRET_TEST, "marker\n", 20.0, 256)))
    run.start()
    try:
        deadline = time.monotonic() + 15
        while not (made and (made[0] / "tests" / "tests.py").exists()):
            assert time.monotonic() < deadline, "the run never created its files"
            time.sleep(0.05)
        time.sleep(0.3)  # both sandboxes started: the files are as they will stay
        base = made[0]
        io_dir = made[1] if len(made) > 1 else base / "io"  # older layouts: io/ in the base
        # Another local user, mid-run: nothing listed, nothing read.
        probes = [("ls", str(base)), ("ls", str(base / "tests")), ("ls", str(io_dir)),
                  ("cat", str(base / "tests" / "tests.py")),
                  ("cat", str(base / "solution" / "solution.py")),
                  ("cat", str(io_dir / "stdin"))]
        for cmd in probes:
            proc = _as(other_user, *cmd)
            assert proc.returncode != 0 and "hidden-" not in proc.stdout, (cmd, proc.stdout)
            assert "Permission denied" in proc.stderr, (cmd, proc.stderr)
        sandbox_uid = pwd.getpwnam("nobody").pw_uid  # what the runner becomes as root
        for path, st in _tree(base):
            if path.is_relative_to(io_dir):
                continue
            want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            assert stat.S_IMODE(st.st_mode) == want, (path, oct(st.st_mode))
            assert st.st_uid == sandbox_uid, (path, st.st_uid)
        for path, st in _tree(io_dir):
            if stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o700, (path, oct(st.st_mode))
            assert st.st_uid == 0 and not st.st_mode & 0o077, (path, oct(st.st_mode))
    finally:
        run.join(timeout=60)
    assert result["returncode"] == 0 and not result["timed_out"], result  # it still scores
    assert not any(p.exists() for p in made)  # and leaves nothing behind
