"""Where a run's secrets go: only into the processes whose stages use them, never into a
worker's environment.

    storage  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN: the S3 store (and
             AWS Lambda, which boto3 signs with the same chain)
    lambda   ROLLART_LAMBDA_ACCESS_KEY_ID / ROLLART_LAMBDA_SECRET_ACCESS_KEY: the key pair of
             the local Lambda endpoint (rollart/rewards/client.py)

A process keeps the secrets it holds in this module's table, in memory. `lookup(var)` reads the
table, then os.environ (an operator who exports keys on their own workers keeps that working);
the store (`rollart.storage.s3.storage_options`) and the reward client sign with what it finds.

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
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:
    from rollart.config import RunConfig

STORAGE_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
LAMBDA_VARS = ("ROLLART_LAMBDA_ACCESS_KEY_ID", "ROLLART_LAMBDA_SECRET_ACCESS_KEY")
SECRET_VARS = STORAGE_VARS + LAMBDA_VARS
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
    (the reward class): the Lambda key pair goes there, and nowhere else."""
    stages = cfg.cluster.stages
    everyone = {stages[r] for r in ("trainer", "engine", "env", "reward")}
    everyone |= set(cfg.cluster.engine_classes(cfg.engine.replicas))
    scorers = {stages["env"], stages["reward"]}
    out: dict[str, set[str]] = {}
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
