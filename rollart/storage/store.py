"""Run store over fsspec: the same code serves a local directory and `s3://bucket/prefix`.

Layout under the root (DESIGN.md):
  runs/{run_id}/config.yaml
  runs/{run_id}/tokenizer/...
  runs/{run_id}/checkpoints/{step:08d}/{model.safetensors, optimizer.pt, state.json, manifest.json}
  runs/{run_id}/trajectories/{step:08d}/part-*.parquet
  runs/{run_id}/metrics.jsonl
A checkpoint without its manifest does not exist: the manifest is written last and lists every
file with its size, so a reader can also detect a torn upload.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq

from rollart.types import Trajectory, table_to_trajectories, trajectories_to_table

MANIFEST = "manifest.json"


class RunStore:
    """Paths and atomic-enough writes for one run, rooted at `root` (path or fsspec URL)."""

    def __init__(self, root: str, run_id: str, storage_options: dict[str, Any] | None = None):
        self.root = root.rstrip("/")
        self.run_id = run_id
        self.fs, base = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        proto = self.fs.protocol
        self.protocol = proto if isinstance(proto, str) else proto[0]
        if self.protocol in ("file", "local"):
            base = os.path.abspath(base)
        self.base = f"{base}/runs/{run_id}"

    # ---- paths -----------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    @property
    def url(self) -> str:
        if self.protocol in ("file", "local"):
            return self.base
        return f"{self.protocol}://{self.base}"

    def checkpoint_dir(self, step: int) -> str:
        return self.path("checkpoints", f"{step:08d}")

    # ---- small files -----------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        full = self.path(rel)
        self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(full, "wb") as f:
            f.write(data)

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open(self.path(rel), "rb") as f:
            return f.read()

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def append_jsonl(self, rel: str, record: dict[str, Any]) -> None:
        """Append one JSON line. Object stores cannot append, so rewrite there (small files)."""
        line = json.dumps(record, sort_keys=True) + "\n"
        full = self.path(rel)
        self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(full, "ab") as f:
                f.write(line.encode())
        except (NotImplementedError, ValueError):
            old = self.read_bytes(rel) if self.exists(rel) else b""
            self.write_bytes(rel, old + line.encode())

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        if not self.exists(rel):
            return []
        return [json.loads(x) for x in self.read_text(rel).splitlines() if x.strip()]

    # ---- directories -----------------------------------------------------------------------
    def put_dir(self, local_dir: str | Path, rel: str) -> None:
        for p in sorted(Path(local_dir).rglob("*")):
            if p.is_file():
                self.write_bytes(f"{rel}/{p.relative_to(local_dir).as_posix()}", p.read_bytes())

    def get_dir(self, rel: str, local_dir: str | Path) -> Path:
        local = Path(local_dir)
        prefix = self.path(rel)
        for full in self.fs.find(prefix):
            dest = local / full[len(prefix) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open(full, "rb") as f:
                dest.write_bytes(f.read())
        return local

    # ---- trajectory shards -----------------------------------------------------------------
    def write_shard(self, step: int, trajs: list[Trajectory], part: int = 0) -> str:
        buf = io.BytesIO()
        pq.write_table(trajectories_to_table(trajs), buf)
        rel = f"trajectories/{step:08d}/part-{part:05d}.parquet"
        self.write_bytes(rel, buf.getvalue())
        return self.path(rel)

    def read_shards(self, step: int | None = None) -> list[Trajectory]:
        pattern = self.path("trajectories", f"{step:08d}" if step is not None else "*", "*.parquet")
        out: list[Trajectory] = []
        for full in sorted(self.fs.glob(pattern)):
            with self.fs.open(full, "rb") as f:
                out.extend(table_to_trajectories(pq.read_table(f)))
        return out

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, step: int, files: dict[str, bytes], meta: dict[str, Any]) -> str:
        """Write every file, then the manifest last. Returns the checkpoint directory."""
        rel = f"checkpoints/{step:08d}"
        t0 = time.perf_counter()
        for name, data in files.items():
            self.write_bytes(f"{rel}/{name}", data)
        manifest = {
            "step": step,
            "run_id": self.run_id,
            "files": {name: len(data) for name, data in files.items()},
            "created": time.time(),
            "write_s": time.perf_counter() - t0,
            **meta,
        }
        self.write_text(f"{rel}/{MANIFEST}", json.dumps(manifest, indent=2, sort_keys=True))
        return self.checkpoint_dir(step)

    def list_checkpoints(self) -> list[int]:
        """Steps of complete checkpoints (manifest present and every listed file full-size)."""
        steps = []
        for full in self.fs.glob(self.path("checkpoints", "*", MANIFEST)):
            step_dir = full.rsplit("/", 2)[-2]
            if step_dir.isdigit() and self._complete(int(step_dir)):
                steps.append(int(step_dir))
        return sorted(steps)

    def _complete(self, step: int) -> bool:
        rel = f"checkpoints/{step:08d}"
        try:
            manifest = json.loads(self.read_text(f"{rel}/{MANIFEST}"))
            return all(
                self.fs.size(self.path(rel, name)) == size
                for name, size in manifest["files"].items()
            )
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            return False

    def latest_checkpoint(self) -> int | None:
        steps = self.list_checkpoints()
        return steps[-1] if steps else None

    def load_checkpoint(self, step: int) -> tuple[dict[str, bytes], dict[str, Any]]:
        rel = f"checkpoints/{step:08d}"
        manifest = json.loads(self.read_text(f"{rel}/{MANIFEST}"))
        return {name: self.read_bytes(f"{rel}/{name}") for name in manifest["files"]}, manifest

    def prune_checkpoints(self, keep_last: int) -> list[int]:
        """Retention: delete all but the newest `keep_last` complete checkpoints (and torn ones
        older than the newest complete one)."""
        complete = self.list_checkpoints()
        keep = set(complete[-keep_last:])
        newest = complete[-1] if complete else -1
        removed = []
        for full in self.fs.glob(self.path("checkpoints", "*")):
            name = full.rsplit("/", 1)[-1]
            if name.isdigit() and int(name) not in keep and int(name) < newest:
                self.fs.rm(full, recursive=True)
                removed.append(int(name))
        return sorted(removed)


def local_tmpdir(prefix: str = "rollart-") -> str:
    return tempfile.mkdtemp(prefix=prefix)


def iter_metrics(store: RunStore) -> Iterable[dict[str, Any]]:
    return store.read_jsonl("metrics.jsonl")
