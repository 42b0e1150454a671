"""Where a run's secrets go: only into the processes whose stages use them, never into a
worker's environment.

    storage  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN: the S3 store (and
             AWS Lambda, which boto3 signs with the same chain)
    lambda   ROLLART_LAMBDA_ACCESS_KEY_ID / ROLLART_LAMBDA_SECRET_ACCESS_KEY: the key pair of
             the local Lambda endpoint (rollart/rewards/client.py)
    checkpoints  ROLLART_CHECKPOINT_KEY: the run owner's key that authenticates checkpoint
             manifests (HMAC-SHA256, rollart/storage/integrity.py): 64 hex digits

A process keeps the secrets it holds in this module's table, in memory. `lookup(var)` reads the
table, then os.environ (an operator who exports keys on their own workers keeps that working);
the store (`rollart.storage.s3.storage_options`) and the reward client sign with what it finds.

The checkpoint key has a home of its own: `checkpoint_key()` takes it from the table or the
environment, else from `<state dir>/checkpoint-key` (`$ROLLART_STATE_DIR`, default `.rollart`:
the stack's private state directory), a file of 32 random bytes, 0600 in a 0700 directory,
created on first use by the run's owner (`rollart train` sets the variable from it,
infra/state.py; a flow that holds none reads it in `plugin_for`; so does a process that signs
and holds none, such as the in-process loop). A run's workers get the flow's key from the
plugin (`scope`: the trainer and engine classes), so a worker on another host signs and
verifies with the owner's key, never one of its own.

`held_out_of_environment()` moves the secrets of this process's environment into the table for
as long as a run lasts, so worker processes started meanwhile (the embedded Dask cluster's
nannies spawn them from this environment, also when they restart one; Slurm jobs export it)
inherit none. `ScopedSecrets` is the Dask worker plugin a run registers (`on_cluster`): each
worker keeps only the secrets its hardware classes need (`scope`), in its table, and forgets
them when the run unregisters the plugin. The plugin's payload crosses the cluster's TLS
connections once per worker; no repr, log line, metric or config dump shows a value.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:
    from rollart.config import RunConfig

STORAGE_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
LAMBDA_VARS = ("ROLLART_LAMBDA_ACCESS_KEY_ID", "ROLLART_LAMBDA_SECRET_ACCESS_KEY")
CHECKPOINT_KEY_VAR = "ROLLART_CHECKPOINT_KEY"
CHECKPOINT_KEY_FILE = "checkpoint-key"
SECRET_VARS = STORAGE_VARS + LAMBDA_VARS + (CHECKPOINT_KEY_VAR,)
PLUGIN_PREFIX = "rollart-secrets-"

_lock = threading.Lock()
_table: dict[str, dict[str, str]] = {}  # owner (a plugin, this process) -> var -> value


def hold(values: Mapping[str, str], owner: str = "process") -> None:
    """Keep `values` (secret vars only) in this process's table under `owner`; the owner held
    last wins a lookup."""
    bad = set(values) - set(SECRET_VARS)
    if bad:
        raise ValueError(f"not a secret this module scopes: {sorted(bad)}")
    with _lock:
        _table.pop(owner, None)
        _table[owner] = {k: v for k, v in values.items() if v}


def release(owner: str = "process") -> None:
    with _lock:
        _table.pop(owner, None)


def lookup(var: str) -> str | None:
    """The value this process holds for `var`: its table (newest owner first), else the
    environment."""
    with _lock:
        for values in reversed(_table.values()):
            if var in values:
                return values[var]
    return os.environ.get(var) or None


def held_vars() -> set[str]:
    """Names (never values) of the secrets in this process's table."""
    with _lock:
        return {k for values in _table.values() for k in values}


def storage_keys() -> tuple[str, str, str | None] | None:
    """(key, secret, token) from the table only; None lets boto3 use its own chain."""
    with _lock:
        for values in reversed(_table.values()):
            if values.get(STORAGE_VARS[0]) and values.get(STORAGE_VARS[1]):
                return values[STORAGE_VARS[0]], values[STORAGE_VARS[1]], values.get(
                    STORAGE_VARS[2])
    return None


class CheckpointKeyError(ValueError):
    """The checkpoint key is unusable (malformed, or its file is not private), in one line that
    never shows the key."""


def state_dir() -> Path:
    """The local state directory, as the stack finds it (infra/stack.py default_state_dir)."""
    return Path(os.environ.get("ROLLART_STATE_DIR", ".rollart"))


def _decode_key(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise CheckpointKeyError(f"{where} is not a checkpoint key (64 hex digits expected)")
    return key


def key_file(path: Path | str, create: bool = False) -> bytes | None:
    """The key in `path` (None when absent and not `create`). Refused unless it is a regular
    file of this user that nobody else can read or write: a key another user can read forges
    checkpoints, one they can write swaps the owner's key for theirs. Created atomically (a
    0600 temporary file linked into place), so two first users never end up with two keys."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if not create:
            return None
        return _create_key(path)
    except OSError as err:  # a symlink (ELOOP), unreadable, ...
        raise CheckpointKeyError(f"checkpoint key file {path} cannot be opened safely "
                                 f"({err.strerror})") from None
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) & 0o077):
            raise CheckpointKeyError(f"checkpoint key file {path} must be a regular file of "
                                     "this user, mode 0600; refusing it")
        return _decode_key(f.read(), f"checkpoint key file {path}")


def _create_key(path: Path) -> bytes:
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = os.urandom(32)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process made the key first: use theirs
        except FileExistsError:
            return key_file(path) or key
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return key


def checkpoint_key(create: bool = False) -> bytes | None:
    """The key that authenticates this user's checkpoints: ROLLART_CHECKPOINT_KEY as this
    process holds it (table, then environment), else `<state dir>/checkpoint-key` (created
    when `create`: only a process about to sign one)."""
    value = lookup(CHECKPOINT_KEY_VAR)
    if value:
        return _decode_key(value, CHECKPOINT_KEY_VAR)
    return key_file(state_dir() / CHECKPOINT_KEY_FILE, create)


@contextlib.contextmanager
def held_out_of_environment(owner: str = "process") -> Iterator[dict[str, str]]:
    """Move this process's secret env vars into its table for the block's duration (child
    processes started meanwhile inherit none); put them back afterwards."""
    moved = {k: os.environ.pop(k) for k in SECRET_VARS if k in os.environ}
    previous = dict(_table.get(owner, {}))
    hold({**previous, **moved}, owner)
    try:
        yield moved
    finally:
        if previous:
            hold(previous, owner)
        else:
            release(owner)
        for k, v in moved.items():
            os.environ.setdefault(k, v)


def _is_s3(root: str) -> bool:
    return root.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in root else False


def scope(cfg: RunConfig) -> dict[str, frozenset[str]]:
    """Secret var -> the hardware classes whose stages use it (absent: nowhere).

    The store is read or written by every role (trainer: checkpoints and published weights;
    engines: the tokenizer, weights, checkpoint restore; env: the tokenizer and the config;
    reward: the Parquet shards), so with an S3 store its keys go to the classes of all four.
    Rewards are scored where the rollout service lives (the env class) and by the score stage
    (the reward class): the Lambda key pair goes there, and nowhere else. The checkpoint key
    goes to the trainer and engine classes of every run."""
    stages = cfg.cluster.stages
    engines = {stages["engine"], *cfg.cluster.engine_classes(cfg.engine.replicas)}
    everyone = {stages[r] for r in ("trainer", "env", "reward")} | engines
    scorers = {stages["env"], stages["reward"]}
    # Checkpoints are signed by the trainer (rank 0 of a sharded one; every rank verifies what
    # it loads) and verified by the engines (their RNG on resume, a checkpoint they serve).
    out: dict[str, set[str]] = {CHECKPOINT_KEY_VAR: {stages["trainer"]} | engines}
    if _is_s3(cfg.storage.root) and not cfg.storage.profile and not cfg.storage.credentials_block:
        for var in STORAGE_VARS:
            out.setdefault(var, set()).update(everyone)
    if cfg.reward.backend == "lambda":
        url = cfg.reward.endpoint_url  # None + embedded: the run's own endpoint, on loopback
        host = urlparse(url).hostname if url else None  # as rewards.client.is_loopback
        local = host in ("127.0.0.1", "localhost", "::1") or (
            url is None and cfg.reward.embedded_endpoint)
        for var in LAMBDA_VARS if local else STORAGE_VARS:  # AWS Lambda signs with AWS_*
            out.setdefault(var, set()).update(scorers)
    return {k: frozenset(v) for k, v in out.items()}


class ScopedSecrets(WorkerPlugin):
    """Gives each worker the secrets its hardware classes (Dask resources) need, in memory."""

    def __init__(self, values: Mapping[str, str], where: Mapping[str, frozenset[str]],
                 name: str | None = None) -> None:
        self.name = name or f"{PLUGIN_PREFIX}{uuid.uuid4().hex[:12]}"
        self._where = {k: frozenset(v) for k, v in where.items() if k in values}
        self._values = {k: values[k] for k in self._where}

    def __repr__(self) -> str:  # never the values
        return f"ScopedSecrets({self.name}, {sorted(self._where)})"

    def for_classes(self, classes: set[str]) -> dict[str, str]:
        return {k: v for k, v in self._values.items() if self._where[k] & classes}

    def setup(self, worker: Any) -> None:
        mine = self.for_classes(set(worker.state.total_resources))
        self._values = {}  # this worker's copy keeps nothing it does not use
        hold(mine, owner=self.name)

    def teardown(self, worker: Any) -> None:
        release(self.name)


def plugin_for(cfg: RunConfig) -> ScopedSecrets | None:
    """The plugin for a run, from what this process holds; None when nothing is needed."""
    where = scope(cfg)
    values = {k: v for k in where if (v := lookup(k))}
    if CHECKPOINT_KEY_VAR in where:  # this process owns the run: its key is the run's key
        values[CHECKPOINT_KEY_VAR] = (checkpoint_key(create=True) or b"").hex()  # checked
    return ScopedSecrets(values, where) if values else None


@contextlib.contextmanager
def on_cluster(client: Any, cfg: RunConfig) -> Iterator[ScopedSecrets | None]:
    """Register the run's `ScopedSecrets` on `client`'s cluster (workers that join later get it
    too) and remove it, and with it the secrets, from every worker when the block ends."""
    plugin = plugin_for(cfg)
    if plugin is not None:
        client.register_plugin(plugin)
    try:
        yield plugin
    finally:
        if plugin is not None:
            with contextlib.suppress(Exception):  # the cluster may already be gone
                client.unregister_worker_plugin(plugin.name)
