"""Local-file durability and tolerant JSON-lines parsing for the run store.

- `atomic_write`: write a temporary file next to the target, fsync it, rename it over the
  target, fsync the directory. A reader (or a resume after a crash or power loss) sees the old
  file or the new one, never a prefix of the new one. `ChunkedBytes` (a checkpoint's large
  files) go to the disk directly where the filesystem allows it (rollart/storage/blob.py).
- `crc32`, `matches_entry`: does a file's content match its manifest entry (size and CRC32)?
- `parse_jsonl`: JSON lines where the last line may be torn (an append cut short by a crash:
  appends are not atomic); a torn trailing line is reported, not fatal. A bad line anywhere
  else is real corruption and raises.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from typing import Any

from rollart.storage.blob import Blob, ChunkedBytes, blob_views, crc32, write_direct

__all__ = ["atomic_write", "crc32", "matches_entry", "parse_jsonl", "want_entry"]


def want_entry(entry: Any) -> dict[str, Any]:
    """A manifest entry as a dict (old manifests list the size only)."""
    return entry if isinstance(entry, dict) else {"bytes": entry}


def matches_entry(data: Blob, entry: Any) -> bool:
    want = want_entry(entry)
    return len(data) == want["bytes"] and ("crc32" not in want or crc32(data) == want["crc32"])


def _open_direct(path: str) -> int | None:
    """`path`, created for writing with O_DIRECT; None where that flag is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0)
    if flags == os.O_WRONLY | os.O_CREAT | os.O_EXCL:
        return None  # no O_DIRECT on this platform
    try:
        return os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.EINVAL:  # this filesystem has no direct I/O
            return None
        raise


def _write_file(tmp: str, data: Blob) -> None:
    """`data` into the new file `tmp`, fsynced."""
    if isinstance(data, ChunkedBytes):
        fd = _open_direct(tmp)
        if fd is not None:
            try:
                direct = write_direct(fd, data)
                if direct:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if direct:
                return
    with open(tmp, "wb") as f:
        for view in blob_views(data):
            f.write(view)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str, data: Blob) -> None:
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    # Hidden, unique per writer: never listed as a shard or checkpoint file, never shared.
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The rename itself must survive a power loss: fsync the directory entry too.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_jsonl(text: str) -> tuple[list[dict[str, Any]], str | None]:
    """(records, the torn trailing line or None). Raises ValueError for a bad line that is not
    the last one."""
    lines = [x for x in text.splitlines() if x.strip()]
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):  # an append cut short
                return out, line
            raise ValueError(f"line {i + 1} is not JSON: {line[:120]!r}") from None
    return out, None
