"""Run store over fsspec: the same code serves a local directory and `s3://bucket/prefix`.

Layout under the root (DESIGN.md):
  runs/{run_id}/config.yaml
  runs/{run_id}/tokenizer/...
  runs/{run_id}/run-files.json  (config.yaml and tokenizer/ signed: rollart/storage/run_files.py)
  runs/{run_id}/checkpoints/{step:08d}/{model.safetensors, optimizer.safetensors, rng.json,
                                        ledger.json, config.yaml, ..., manifest.json}
  runs/{run_id}/trajectories/{step:08d}/part-*.parquet
  runs/{run_id}/weights/v{version}/{model.safetensors, manifest.json}
  runs/{run_id}/metrics.jsonl
A checkpoint without its manifest does not exist: the manifest is written last, lists every file
with its size, CRC32 and SHA-256 and is signed with the run owner's key (the checkpoint methods:
rollart/storage/checkpoint_store.py), so a reader detects a torn, corrupt or altered checkpoint
and a resume falls back to the previous one. Local files are written atomically (temporary
file, fsync, rename); appends to JSON lines are not, so a torn trailing line is ignored with a
warning when read.

Every operation goes through `retrying` (rollart/storage/s3.py): transient errors (server down
or restarting, timeouts, 5xx) are retried with backoff for `retry_timeout_s`.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rollart.storage.blob import Blob, ChunkedBytes, as_bytes
from rollart.storage.checkpoint_store import MANIFEST as MANIFEST  # re-exported
from rollart.storage.checkpoint_store import CheckpointStore, checkpoint_rel
from rollart.storage.files import atomic_write, parse_jsonl
from rollart.storage.s3 import StorageError, retrying, storage_options
from rollart.types import Trajectory, table_to_trajectories, trajectories_to_table

if TYPE_CHECKING:
    from rollart.config import StorageConfig

CHUNK = 8 * 2**20  # multipart part size / ranged-read size for large objects
T = TypeVar("T")
log = logging.getLogger("rollart.storage")


def shard_rel(step: int) -> str:
    """The trajectory shards of iteration `step`, relative to the run."""
    return f"trajectories/{step:08d}"


def eval_rel(step: int) -> str:
    """The evaluation results of checkpoint `step`, relative to the run."""
    return f"eval/{step:08d}.json"


class RunStore(CheckpointStore):
    """Paths and atomic-enough writes for one run, rooted at `root` (path or fsspec URL).
    `storage_options` reach an object store (endpoint, credentials): `from_config` builds them
    from the storage config; without them fsspec's defaults apply (environment credentials)."""

    def __init__(self, root: str, run_id: str, storage_options: dict[str, Any] | None = None,
                 retry_timeout_s: float | None = None):
        self.root = root.rstrip("/")
        self.run_id = run_id
        self.retry_timeout_s = retry_timeout_s or 120.0
        self.fs, base = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        proto = self.fs.protocol
        self.protocol = proto if isinstance(proto, str) else proto[0]
        self.local = self.protocol in ("file", "local")
        if self.local:
            base = os.path.abspath(base)
        self.base = f"{base}/runs/{run_id}"

    @classmethod
    def from_config(cls, cfg: StorageConfig, run_id: str) -> RunStore:
        """The run's store as configured (endpoint, region, credentials, retry budget)."""
        return cls(cfg.root, run_id, storage_options(cfg), cfg.retry_timeout_s)

    # ---- paths -----------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    @property
    def url(self) -> str:
        return self.base if self.local else f"{self.protocol}://{self.base}"

    def uri(self, *parts: str) -> str:
        """Like `path`, as a URL for object stores (s3://...), a plain path locally."""
        full = self.path(*parts)
        return full if self.local else f"{self.protocol}://{full}"

    def checkpoint_dir(self, step: int) -> str:
        return self.uri(checkpoint_rel(step))

    def _io(self, what: str, fn: Callable[[], T]) -> T:
        return retrying(fn, f"{what} ({self.url})", timeout_s=self.retry_timeout_s)

    # ---- small and large files -----------------------------------------------------------------
    def write_bytes(self, rel: str, data: Blob) -> None:
        full = self.path(rel)

        def put() -> None:
            if self.local:  # a crash leaves the old file or the new one, never half of one
                atomic_write(full, data)
            else:  # concurrent multipart above 2 parts; a retry rewrites the whole object
                self.fs.pipe_file(full, _s3_body(data), chunksize=CHUNK)

        self._io(f"write {rel}", put)

    def read_bytes(self, rel: str) -> bytes:
        full = self.path(rel)
        if self.local:
            return self._io(f"read {rel}", lambda: self.fs.cat_file(full))
        return self._io(f"read {rel}", lambda: self.fs.cat_file(full, chunksize=CHUNK))

    def write_many(self, files: dict[str, Blob]) -> None:
        """Write several objects at once (S3: every file's parts upload concurrently)."""
        if self.local or len(files) < 2:
            for rel, data in files.items():
                self.write_bytes(rel, data)
            return
        full = {self.path(rel): _s3_body(data) for rel, data in files.items()}
        self._io(f"write {len(files)} files under {os.path.commonpath(list(files))!r}",
                 lambda: self.fs.pipe(full, chunksize=CHUNK))

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """Read several objects at once (S3: concurrent ranged reads across files)."""
        if self.local or len(rels) < 2:
            return {rel: self.read_bytes(rel) for rel in rels}
        full = {self.path(rel): rel for rel in rels}

        def cat() -> dict[str, bytes]:
            out = self.fs.cat(list(full), chunksize=CHUNK)
            return {full[self.fs._strip_protocol(k)]: v for k, v in out.items()}

        return self._io(f"read {len(rels)} files", cat)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def exists(self, rel: str) -> bool:
        return self._io(f"stat {rel}", lambda: self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int | None:
        def stat() -> int | None:
            try:
                return int(self.fs.size(self.path(rel)))
            except FileNotFoundError:
                return None

        return self._io(f"stat {rel}", stat)

    def delete(self, rel: str, recursive: bool = True) -> None:
        full = self.path(rel)

        def rm() -> None:
            try:
                self.fs.rm(full, recursive=recursive)
            except FileNotFoundError:
                pass

        self._io(f"delete {rel}", rm)

    def listdir(self, rel: str) -> list[str]:
        """Names directly under `rel` (files and prefixes); [] when it does not exist."""
        full = self.path(rel)

        def ls() -> list[str]:
            try:
                return sorted(p.rstrip("/").rsplit("/", 1)[-1]
                              for p in self.fs.ls(full, detail=False))
            except FileNotFoundError:
                return []

        return self._io(f"list {rel}", ls)

    def append_jsonl(self, rel: str, record: dict[str, Any]) -> None:
        """Append one JSON line. Object stores cannot append, so rewrite there (small files)."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        if self.local:
            full = self.path(rel)

            def append() -> None:
                self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
                with self.fs.open(full, "ab") as f:
                    f.write(line)

            self._io(f"append {rel}", append)
            return
        old = self.read_bytes(rel) if self.exists(rel) else b""
        self.write_bytes(rel, old + line)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        return self.read_jsonl_torn(rel)[0]

    def read_jsonl_torn(self, rel: str) -> tuple[list[dict[str, Any]], bool]:
        """(records, whether a torn trailing line was dropped). A writer that died mid-append
        leaves a partial last line: it is ignored, with a warning; any other bad line raises."""
        if not self.exists(rel):
            return [], False
        try:
            rows, torn = parse_jsonl(self.read_text(rel))
        except ValueError as err:
            raise StorageError(f"storage: {self.uri(rel)} is corrupt: {err}") from None
        if torn is not None:
            log.warning("storage: ignoring a torn last line of %s (an interrupted append): %r",
                        self.uri(rel), torn[:120])
        return rows, torn is not None

    def write_jsonl(self, rel: str, records: Iterable[dict[str, Any]]) -> None:
        self.write_bytes(rel, "".join(json.dumps(r, sort_keys=True) + "\n"
                                      for r in records).encode())

    # ---- directories -----------------------------------------------------------------------
    def put_dir(self, local_dir: str | Path, rel: str) -> None:
        for p in sorted(Path(local_dir).rglob("*")):
            if p.is_file():
                self.write_bytes(f"{rel}/{p.relative_to(local_dir).as_posix()}", p.read_bytes())

    def get_dir(self, rel: str, local_dir: str | Path) -> Path:
        local = Path(local_dir)
        prefix = self.path(rel)
        for full in self._io(f"list {rel}", lambda: self.fs.find(prefix)):
            name = full[len(prefix) + 1:]
            dest = local / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(self.read_bytes(f"{rel}/{name}"))
        return local

    # ---- trajectory shards -----------------------------------------------------------------
    def write_shard(self, step: int, trajs: list[Trajectory], part: int = 0) -> str:
        buf = io.BytesIO()
        pq.write_table(trajectories_to_table(trajs), buf)
        rel = f"{shard_rel(step)}/part-{part:05d}.parquet"
        self.write_bytes(rel, buf.getvalue())
        return self.path(rel)

    def shard_steps(self) -> list[int]:
        return sorted(int(n) for n in self.listdir("trajectories") if n.isdigit())

    def read_shard_table(self, step: int | None = None) -> pa.Table:
        """Shards as one Arrow table (all steps, or one), e.g. `.to_pandas()` for analysis."""
        steps = [step] if step is not None else self.shard_steps()
        tables = []
        for s in steps:
            for name in self.listdir(shard_rel(s)):
                if name.endswith(".parquet"):
                    data = self.read_bytes(f"{shard_rel(s)}/{name}")
                    tables.append(pq.read_table(io.BytesIO(data)))
        if not tables:
            from rollart.types import TRAJECTORY_SCHEMA

            return TRAJECTORY_SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def read_shards(self, step: int | None = None) -> list[Trajectory]:
        return table_to_trajectories(self.read_shard_table(step))


def _s3_body(data: Blob) -> Blob:
    """What s3fs uploads: a multipart upload (two parts or more) cuts its parts by slicing,
    which ChunkedBytes answers with bytes; a single PUT needs bytes."""
    if isinstance(data, ChunkedBytes) and len(data) >= 2 * CHUNK:
        return data
    return as_bytes(data)
