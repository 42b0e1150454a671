"""The checkpoint half of `RunStore` (a mixin, so the store module stays readable):
`checkpoints/{step:08d}/...` written with the manifest last, listed, verified, loaded, pruned.

The manifest lists every file with its size, CRC32 and SHA-256, is signed with the run owner's
key and names only files inside the checkpoint (rollart/storage/integrity.py); `read_manifest`
and `load_checkpoint` refuse anything else in one line (`CheckpointRefused`), and
`checkpoint_problems` says which files of a checkpoint are torn, corrupt, altered or unloadable
(a resume then falls back to the previous checkpoint, rollart/storage/resume.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollart.storage.blob import Blob
from rollart.storage.integrity import (
    MANIFEST,
    CheckpointRefused,
    digests,
    file_problem,
    sign,
    signing_key,
    unsafe_names,
    verify_manifest,
)

# Test hook: "STEP:SECONDS" sleeps between the files of checkpoint STEP (a wide, deterministic
# window in which an upload is in flight, e.g. to kill the process there).
SLOW_CHECKPOINT_ENV = "ROLLART_FAULT_SLOW_CHECKPOINT"
LINK_OUT = "is a link out of the checkpoint directory (not followed)"
log = logging.getLogger("rollart.storage")


def checkpoint_rel(step: int) -> str:
    """A checkpoint's directory, relative to the run."""
    return f"checkpoints/{step:08d}"


class CheckpointStore:
    """Checkpoint operations over the run store's primitives (`RunStore` provides them:
    `run_id`, `exists`, `size`, `delete`, `listdir`, `read_bytes`, `read_many`, `write_bytes`,
    `write_many`, `read_text`, `write_text`, `checkpoint_dir`)."""

    run_id: str

    def save_checkpoint(self, step: int, files: dict[str, Blob], meta: dict[str, Any],
                        written: dict[str, dict[str, Any]] | None = None) -> str:
        """Write every file, then the manifest last. Returns the checkpoint directory.
        `written`: entries of files other processes already wrote into this checkpoint (a
        sharded trainer's ranks, `write_checkpoint_files`), listed in the manifest too."""
        rel = checkpoint_rel(step)
        t0 = time.perf_counter()
        key = signing_key()  # before any file: a writer that cannot sign writes nothing
        if self.exists(f"{rel}/{MANIFEST}"):  # rewriting a step: it stops existing first
            self.delete(f"{rel}/{MANIFEST}")
        entries = {**(written or {}), **self.write_checkpoint_files(step, files)}
        write_s = time.perf_counter() - t0
        manifest = {
            "step": step,
            "run_id": self.run_id,
            "files": entries,
            "bytes": sum(e["bytes"] for e in entries.values()),
            "created": time.time(),
            "write_s": write_s,
            **meta,
        }
        self.write_text(f"{rel}/{MANIFEST}", json.dumps(sign(manifest, key), indent=2,
                                                        sort_keys=True))
        return self.checkpoint_dir(step)

    def write_checkpoint_files(self, step: int, files: dict[str, Blob]
                               ) -> dict[str, dict[str, Any]]:
        """Write files into checkpoint `step` (no manifest); returns their manifest entries
        (size, CRC32, SHA-256)."""
        rel = checkpoint_rel(step)
        delay = _slow_checkpoint_delay(step)
        with ThreadPoolExecutor(1) as pool:  # digests (they drop the GIL) while uploading
            sums = pool.submit(lambda: [digests(data) for data in files.values()])
            if delay:
                for name, data in files.items():
                    self.write_bytes(f"{rel}/{name}", data)
                    time.sleep(delay)
            else:
                self.write_many({f"{rel}/{name}": data for name, data in files.items()})
            return dict(zip(files, sums.result(), strict=True))

    def drop_manifest(self, step: int) -> None:
        """Checkpoint `step` stops existing (before its files are rewritten)."""
        rel = checkpoint_rel(step)
        if self.exists(f"{rel}/{MANIFEST}"):
            self.delete(f"{rel}/{MANIFEST}")

    def _manifest(self, rel: str) -> dict[str, Any] | None:
        """The manifest as stored (None: absent, or not a JSON object: a torn write)."""
        try:
            manifest = json.loads(self.read_text(f"{rel}/{MANIFEST}"))
        except (FileNotFoundError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def outside_checkpoint(self, step: int, name: str) -> bool:
        """Whether file `name` of checkpoint `step` resolves outside the checkpoint's directory
        (a local store where someone planted a symlink, to the file or to a directory above
        it); object stores have no links."""
        if not getattr(self, "local", False):
            return False
        inside = os.path.join(os.path.realpath(self.path()), checkpoint_rel(step)) + os.sep
        return not os.path.realpath(self.path(checkpoint_rel(step), name)).startswith(inside)

    def _complete(self, step: int) -> dict[str, Any] | None:
        """The manifest when every listed file is present at its listed size, else None. A
        manifest naming a file outside the checkpoint (by name or through a link) is returned
        unlooked-at: listed, so the resume refuses it in one line, never a stat outside."""
        manifest = self._manifest(checkpoint_rel(step))
        if manifest is None or not isinstance(manifest.get("files"), dict):
            return None
        names = manifest["files"]
        if unsafe_names(manifest) or any(self.outside_checkpoint(step, n) for n in names):
            return manifest
        rel = checkpoint_rel(step)
        for name, entry in manifest["files"].items():
            want = entry.get("bytes") if isinstance(entry, dict) else entry
            if self.size(f"{rel}/{name}") != want:
                return None
        return manifest

    def checkpoint_steps(self) -> list[int]:
        """Every checkpoint directory, complete or not."""
        return sorted(int(n) for n in self.listdir("checkpoints") if n.isdigit())

    def list_checkpoints(self) -> list[int]:
        """Steps of complete checkpoints (manifest present and every listed file full-size)."""
        return [s for s in self.checkpoint_steps() if self._complete(s) is not None]

    def latest_checkpoint(self) -> int | None:
        for s in reversed(self.checkpoint_steps()):
            if self._complete(s) is not None:
                return s
        return None

    def latest_authentic_checkpoint(self) -> int | None:
        """The newest complete checkpoint whose manifest is authentic (what an evaluation or a
        continued run starts from by default; its files are checked as they are loaded). A
        newer one that is refused is skipped with one warning line naming why."""
        for s in reversed(self.list_checkpoints()):
            try:
                self.read_manifest(s)
                return s
            except CheckpointRefused as err:
                log.warning("%s; using an earlier checkpoint", err)
        return None

    def unverified_manifest(self, step: int) -> dict[str, Any] | None:
        """Checkpoint `step`'s manifest as stored, NOT authenticated (listing, adoption)."""
        return self._manifest(checkpoint_rel(step))

    def read_manifest(self, step: int) -> dict[str, Any]:
        """The manifest of checkpoint `step`, authenticated (CheckpointRefused otherwise)."""
        manifest = self._manifest(checkpoint_rel(step))
        if manifest is None:
            raise FileNotFoundError(f"checkpoint {step} of run {self.run_id} has no manifest")
        verify_manifest(manifest, step, self.run_id)
        return manifest

    def load_checkpoint(self, step: int, only: Iterable[str] | None = None,
                        ) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Files of a complete checkpoint (all, or `only` these names), verified against the
        authenticated manifest's sizes and SHA-256s, and their headers."""
        rel = checkpoint_rel(step)
        manifest = self.read_manifest(step)
        names = [n for n in manifest["files"] if only is None or n in set(only)]
        for name in names:
            if self.outside_checkpoint(step, name):
                raise CheckpointRefused(step, self.run_id, name, LINK_OUT)
        raw = self.read_many([f"{rel}/{n}" for n in names])
        files = {name: raw[f"{rel}/{name}"] for name in names}

        def problem(name: str) -> str | None:
            return file_problem(name, files[name], manifest["files"][name])

        with ThreadPoolExecutor(max(1, min(4, len(names)))) as pool:  # SHA-256 drops the GIL
            for name, why in zip(names, pool.map(problem, names), strict=True):
                if why:
                    raise CheckpointRefused(step, self.run_id, name, why)
        return files, manifest

    def checkpoint_problems(self, step: int) -> dict[str, str]:
        """{file: why} for the files of complete checkpoint `step` that are missing, do not
        match the manifest (bit rot, a partial overwrite, a bad copy, an altered file) or have
        a corrupt header; {} when it is intact. Raises CheckpointRefused when the manifest
        itself is refused. Reads the files one at a time (a checkpoint need not fit in memory
        twice)."""
        rel = checkpoint_rel(step)
        manifest = self.read_manifest(step)
        bad = {}
        for name, entry in manifest["files"].items():
            if self.outside_checkpoint(step, name):
                bad[name] = LINK_OUT
                continue
            try:
                data = self.read_bytes(f"{rel}/{name}")
            except FileNotFoundError:
                bad[name] = "is missing"
                continue
            problem = file_problem(name, data, entry)
            if problem:
                bad[name] = problem
        return bad

    def corrupt_files(self, step: int) -> list[str]:
        """Names of the bad files of checkpoint `step` (`checkpoint_problems`)."""
        return list(self.checkpoint_problems(step))

    def prune_checkpoints(self, keep_last: int) -> list[int]:
        """Retention: delete all but the newest `keep_last` complete checkpoints (and torn ones
        older than the newest complete one; newer torn ones may still be uploading)."""
        complete = self.list_checkpoints()
        keep = set(complete[-keep_last:])
        newest = complete[-1] if complete else -1
        removed = []
        for step in self.checkpoint_steps():
            if step not in keep and step < newest:
                self.delete(checkpoint_rel(step))
                removed.append(step)
        return removed


def _slow_checkpoint_delay(step: int) -> float:
    spec = os.environ.get(SLOW_CHECKPOINT_ENV, "")
    if not spec:
        return 0.0
    at, _, seconds = spec.partition(":")
    return float(seconds or 0) if at.strip() in ("*", str(step)) else 0.0

