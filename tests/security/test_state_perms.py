"""The stack's state directory holds secrets (prefect.db and the key that decrypts block
secrets, the S3 and Lambda key pairs): 0700, files 0600 from creation, under a permissive umask
too, and what the stack's processes create (through `Stack._spawn`, `start_server`,
SeaweedFS) is created under umask 077. Another local user cannot read them (tried for real as
`nobody` when running as root)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from infra.stack import Stack
from infra.state import lambda_credentials, private_dir, write_private


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)  # the usual default: 0644 files, 0755 dirs
    yield
    os.umask(old)


def _other_user_reads(path: Path) -> bool:
    """Can `nobody` read `path`? A real attempt from another uid (root can switch to it)."""
    nobody = pwd.getpwnam("nobody")
    proc = subprocess.run(["cat", str(path)], user=nobody.pw_uid, group=nobody.pw_gid,
                          extra_groups=[], capture_output=True, timeout=30)
    return proc.returncode == 0


@pytest.fixture
def shared_parent():
    """A world-traversable directory, like a project checkout on a shared host (pytest's own
    tmp_path is private already, which would make the attempt below prove nothing)."""
    d = Path(tempfile.mkdtemp(prefix="rollart-shared-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_credentials_and_state_files_are_private(tmp_path, loose_umask):
    state = tmp_path / "state"
    creds = lambda_credentials(state)
    assert creds is not None and _mode(state) == 0o700
    f = state / "lambda-credentials.json"
    assert _mode(f) == 0o600 and creds.secret_key in f.read_text()
    assert creds.secret_key not in repr(creds)
    assert lambda_credentials(state, create=False) == creds  # reused, not regenerated
    stack = Stack(state)
    stack._save()
    assert _mode(state / "stack.json") == 0o600


def test_new_parents_are_private_too(tmp_path, loose_umask):
    seaweed = private_dir(tmp_path / "fresh" / ".rollart" / "seaweed")  # as infra.seaweed does
    assert _mode(seaweed) == _mode(seaweed.parent) == _mode(seaweed.parent.parent) == 0o700
    tmp_path.chmod(0o755)  # an existing parent (say, the project checkout) is left as it is
    private_dir(tmp_path / "another")
    assert _mode(tmp_path) == 0o755 and _mode(tmp_path / "another") == 0o700


def test_existing_loose_paths_are_tightened_and_symlinks_not_followed(tmp_path, loose_umask):
    d = tmp_path / "old-state"
    d.mkdir(mode=0o755)
    (d / "stack.json").write_text("{}")
    os.chmod(d / "stack.json", 0o644)
    private_dir(d)
    write_private(d / "stack.json", "{}")
    assert _mode(d) == 0o700 and _mode(d / "stack.json") == 0o600
    # A symlink planted where a secret will be written: refused, the target stays untouched.
    target = tmp_path / "attacker-readable"
    target.write_text("")
    (d / "lambda-credentials.json").symlink_to(target)
    with pytest.raises(OSError):
        write_private(d / "lambda-credentials.json", "secret")
    assert target.read_text() == ""


def test_stack_children_create_private_files(tmp_path, loose_umask):
    state = private_dir(tmp_path / "state")
    stack = Stack(state)
    out = state / "made-by-child"
    pid = stack._spawn("probe", [sys.executable, "-c", f"open({str(out)!r}, 'w').write('x')"],
                       token="probe", env=dict(os.environ))
    deadline = time.monotonic() + 20
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.waitpid(pid, 0)
    assert _mode(out) == 0o600 and _mode(state / "probe.log") == 0o600
    assert _mode(state / "probe.pid") == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_local_user_cannot_read_the_secrets(shared_parent, loose_umask):
    state = shared_parent / ".rollart"
    creds = lambda_credentials(state)
    assert creds is not None
    Stack(state)._save()
    control = shared_parent / "README"  # an ordinary file beside it: the probe can read that
    control.write_text("hello")
    assert _other_user_reads(control)
    for name in ("lambda-credentials.json", "stack.json"):
        assert not _other_user_reads(state / name), name
