"""The stack's private state directory: 0700, files 0600, before any secret lands in it.

The state directory holds the Prefect database (and the key that decrypts block secrets), the
local S3 and Lambda key pairs, the key that signs this user's checkpoints, logs and pid files.
On a shared host every other local user could read them if they were created with the default
umask (0644 files in a 0755 dir), so:

- `private_dir` creates the directory 0700, or tightens an existing one to 0700;
- `write_private` creates or rewrites a file 0600 (O_NOFOLLOW: a planted symlink is not
  followed to somewhere else), the mode set at creation, never chmod'ed after the write;
- `PRIVATE_UMASK` is the umask the stack's child processes run under, so what they create
  (prefect.db, SeaweedFS data, Dask spill files) is private too.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from rollart.rewards.client import LambdaCredentials

PRIVATE_UMASK = 0o077
LAMBDA_CREDENTIALS = "lambda-credentials.json"
CHECKPOINT_KEY = "checkpoint-key"  # the name rollart.secrets.checkpoint_key looks for


def private_dir(path: Path | str) -> Path:
    """`path` as a 0700 directory. Parents it has to create are 0700 too (mkdir(parents=True)
    would make them with the umask's mode); existing parents are left as they are."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
        d.chmod(0o700)
    if stat.S_IMODE(path.stat().st_mode) != 0o700:
        path.chmod(0o700)
    return path


def _open_private(path: Path, flags: int) -> int:
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    return fd


def write_private(path: Path | str, data: str | bytes) -> None:
    raw = data.encode() if isinstance(data, str) else data
    fd = _open_private(Path(path), os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def append_private(path: Path | str) -> IO[bytes]:
    """A log file opened for appending, 0600."""
    return os.fdopen(_open_private(Path(path), os.O_WRONLY | os.O_APPEND), "ab")


def lambda_credentials(state: Path | str, create: bool = True) -> LambdaCredentials | None:
    """The local Lambda endpoint's key pair, kept in the state directory (created on first use
    when `create`). A pair of its own: it does not open S3, and the S3 keys do not open it."""
    from rollart.rewards.client import LambdaCredentials  # lazy: this module stays light

    f = Path(state) / LAMBDA_CREDENTIALS
    try:
        doc = json.loads(f.read_text())
        return LambdaCredentials(doc["access_key"], doc["secret_key"])
    except (OSError, ValueError, KeyError):
        if not create:
            return None
    creds = LambdaCredentials.generate()
    private_dir(f.parent)
    write_private(f, json.dumps({"access_key": creds.access_key,
                                 "secret_key": creds.secret_key}))
    return creds


def checkpoint_key(state: Path | str, create: bool = True) -> str | None:
    """The key that authenticates this user's checkpoints (64 hex digits), kept in the state
    directory, 0600 in a 0700 directory (created on first use when `create`). `rollart train`
    hands it to the run as ROLLART_CHECKPOINT_KEY; the run keeps it out of its workers'
    environment and gives it to the trainer and engine classes only (rollart/secrets.py)."""
    from rollart.secrets import key_file  # lazy: this module stays light

    if create:
        private_dir(state)
    key = key_file(Path(state) / CHECKPOINT_KEY, create=create)
    return key.hex() if key is not None else None
