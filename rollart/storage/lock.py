"""One writer per run id: `RunLock` is held by the process that drives a run, from before it
touches the run's files (resume rollback included) until the run ends or aborts.

A second `rollart train --run-id X` (or `--resume X`) while X is live would roll back the live
run's files; with the lock it fails fast, naming the holder (host, pid, since).

- Local store: `fcntl.flock` on `runs/{id}/run.lock`, kept open for the run. The kernel drops
  the lock when the holder dies (even `kill -9`), so a dead run's lock is never stale and
  `--resume` works at once. The file also carries the holder's description for the error. It
  is never deleted (deleting a flocked file lets a late opener lock the orphaned inode while a
  third process locks a new file). Covers writers on one host, or a filesystem whose flock is
  coherent across hosts.
- Object store: `runs/{id}/run.lock` is a JSON object naming the holder with a heartbeat,
  refreshed every `ttl_s / 3` by a daemon thread. A lock whose heartbeat is older than `ttl_s`
  is stale (its holder died), as is one on this host whose pid no longer exists. S3 has no
  portable compare-and-set, so acquiring is write, wait `settle_s`, read back: two writers that
  both read "free" see the later write and only that one proceeds. Remaining race window: a
  writer whose read-then-write gap exceeds `settle_s` (a stall of hundreds of ms between two
  requests); clocks are compared across hosts, so skew must stay well below `ttl_s`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from rollart.storage.s3 import StorageError

if TYPE_CHECKING:
    from rollart.config import StorageConfig
    from rollart.storage.store import RunStore

log = logging.getLogger("rollart.storage")
LOCK = "run.lock"


class RunLockedError(StorageError):
    """Another live process writes this run; the message names it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def describe_holder(holder: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("since", 0))))
    text = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} since {since}"
    if "heartbeat" in holder:
        text += f", heartbeat {now - float(holder['heartbeat']):.0f}s ago"
    return text


class RunLock:
    """Exclusive writer lock of one run (module docstring). `acquire` raises RunLockedError."""

    def __init__(self, store: RunStore, ttl_s: float = 60.0, settle_s: float = 0.5) -> None:
        self.store, self.ttl_s, self.settle_s = store, ttl_s, settle_s
        self.holder = {"owner": uuid.uuid4().hex, "host": socket.gethostname(),
                       "pid": os.getpid(), "since": time.time()}
        self.held = False
        self.lost = False  # object store: another writer's lock replaced ours
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refuse(self, holder: dict[str, Any]) -> RunLockedError:
        return RunLockedError(
            f"storage: run {self.store.run_id!r} under {self.store.url} is being written by "
            f"another process ({describe_holder(holder)}); stop it, or wait for it to end, "
            "before starting or resuming this run id")

    def acquire(self) -> RunLock:
        if self.held:
            return self
        if self.store.local:
            self._acquire_local()
        else:
            self._acquire_object()
        self.held = True
        return self

    # ---- local: flock -------------------------------------------------------------------------
    def _acquire_local(self) -> None:
        import fcntl

        path = self.store.path(LOCK)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            os.close(fd)
            raise self._refuse(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.holder).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    # ---- object store: heartbeat object ------------------------------------------------------
    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.store.read_bytes(LOCK) or b"null")
        except (FileNotFoundError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("owner") else None

    def _stale(self, holder: dict[str, Any]) -> bool:
        if time.time() - float(holder.get("heartbeat", 0)) > self.ttl_s:
            return True
        # Same host: a dead pid is a dead run, no need to wait for the heartbeat to expire.
        pid = holder.get("pid")
        return (holder.get("host") == self.holder["host"] and isinstance(pid, int) and pid > 0
                and not _pid_alive(pid))

    def _write(self) -> None:
        self.store.write_bytes(LOCK, json.dumps({**self.holder,
                                                 "heartbeat": time.time()}).encode())

    def _acquire_object(self) -> None:
        holder = self._read()
        if holder is not None and not self._stale(holder):
            raise self._refuse(holder)
        if holder is not None:
            log.warning("storage: taking over the stale lock of run %r (%s)", self.store.run_id,
                        describe_holder(holder))
        self._write()
        time.sleep(self.settle_s)  # let a concurrent writer's put land, then see who won
        now = self._read()
        if now is None or now["owner"] != self.holder["owner"]:
            raise self._refuse(now or {})
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                now = self._read()
                if now is not None and now["owner"] != self.holder["owner"]:
                    self.lost = True
                    log.error("storage: run %r lock taken over by %s; this process no longer "
                              "owns the run", self.store.run_id, describe_holder(now))
                    return
                self._write()
            except Exception as err:  # noqa: BLE001 - the store retries; a miss is survivable
                log.warning("storage: run lock heartbeat failed: %s", err)

    # ---- release ------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the run up (end of run, abort). Idempotent; never raises."""
        if not self.held:
            return
        self.held = False
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # no holder to name
                os.close(self._fd)  # closing drops the flock
            self._fd = None
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5.0)
        try:
            now = self._read()
            if now is not None and now["owner"] == self.holder["owner"]:
                self.store.delete(LOCK, recursive=False)
        except Exception as err:  # noqa: BLE001 - a leftover lock expires after ttl_s
            log.warning("storage: could not release the run lock: %s", err)


def run_lock(cfg: StorageConfig, run_id: str) -> RunLock:
    """The (not yet acquired) writer lock of run `run_id` in the configured store."""
    from rollart.storage.store import RunStore

    return RunLock(RunStore.from_config(cfg, run_id), cfg.lock_ttl_s)
