"""Reaching the store: fsspec options for S3, credentials, retries, and the start-up check.

`storage_options(cfg)` turns a StorageConfig into s3fs options (endpoint, region, credentials
from the environment, a profile or a Prefect Secret block, botocore retries). `retrying` re-runs
an operation on transient errors (connection refused or reset, timeouts, 5xx) with jittered
exponential backoff until `retry_timeout_s`, so a restarted S3 server does not fail a run;
wrong credentials, missing keys and other permanent errors surface at once. `check_storage` is
called at flow start, before any cluster starts, and turns every access problem into one line.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

# Retry jitter draws from its own generator: the run's global `random` state is checkpointed
# (rng.json), and a retry that happened in one run and not in its resumed twin made them differ.
_JITTER = random.Random()

if TYPE_CHECKING:
    from rollart.config import StorageConfig

log = logging.getLogger("rollart.storage")
T = TypeVar("T")

# errno values s3fs uses for 5xx/throttling answers (EBUSY: 503/SlowDown, EREMOTEIO: 500), plus
# socket-level failures; EIO is s3fs's "unrecognised error code".
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EIO, errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                    errno.EPIPE, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                    getattr(errno, "EREMOTEIO", 121)}
_PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError)


class StorageError(RuntimeError):
    """A storage problem phrased as one line: what failed, where, and how to fix it."""


def is_s3(root: str) -> bool:
    return root.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in root else False


def _chain(err: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        out.append(cur)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return out


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: the server is down, restarting, slow or overloaded."""
    first = err
    if isinstance(first, _PERMANENT):
        return False
    for e in _chain(err):
        name = type(e).__name__
        mod = type(e).__module__
        if mod.startswith("botocore") and name in ("NoCredentialsError", "PartialCredentialsError",
                                                   "ParamValidationError"):
            return False
        if mod.startswith(("botocore", "aiohttp", "urllib3")) and (
            "Connection" in name or "Timeout" in name or "HTTPClient" in name
            or "Disconnected" in name or "Payload" in name or "Endpoint" in name
        ):
            return True
        if isinstance(e, TimeoutError | ConnectionError) or name == "FSTimeoutError":
            return True
        if mod.startswith("botocore") and name == "ClientError":
            code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
            status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout") or (
                    isinstance(status, int) and status >= 500):
                return True
        if isinstance(e, OSError) and not isinstance(e, _PERMANENT) and e.errno in _TRANSIENT_ERRNO:
            return True
    return False


def retrying(fn: Callable[[], T], what: str, timeout_s: float = 120.0,
             base_s: float = 0.2, max_s: float = 5.0) -> T:
    """Run `fn()`; on a transient error wait (jittered exponential backoff) and run it again
    until `timeout_s` has passed, then raise StorageError naming `what` and the last error."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - classified below
            if not is_transient(err):
                raise
            attempt += 1
            wait = min(max_s, base_s * 2 ** (attempt - 1)) * (0.5 + _JITTER.random() / 2)
            if time.monotonic() + wait > deadline:
                raise StorageError(
                    f"storage: {what} still failing after {attempt} attempts over "
                    f"{timeout_s:.0f}s: {type(err).__name__}: {_one_line(err)}"
                ) from err
            log.warning("storage: %s failed (%s: %s); retry %d in %.1fs", what,
                        type(err).__name__, _one_line(err), attempt, wait)
            time.sleep(wait)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


# ---- credentials and options ----------------------------------------------------------------
# `storage.credentials_block` names a secret (block name -> secret value); the orchestration
# layer installs the resolver that reads it, explicitly, in each process that opens the store
# (the flows install Prefect's Secret block in the flow process and, through a worker plugin,
# on every Dask worker), so the core library never imports Prefect.
CredentialsResolver = Callable[[str], Any]
_resolver: CredentialsResolver | None = None


def install_credentials_resolver(resolver: CredentialsResolver | None) -> None:
    """Make `resolver(name)` the source of `storage.credentials_block` secrets in this process
    (None removes it)."""
    global _resolver
    _resolver = resolver
    _block_credentials.cache_clear()


@functools.lru_cache(maxsize=16)
def _block_credentials(name: str) -> tuple[str, str, str | None]:
    """Read a secret credentials block (only runs when `storage.credentials_block` is set)."""
    if _resolver is None:
        raise StorageError(
            f"storage.credentials_block={name!r} needs a credentials resolver in this process: "
            "the Prefect flows install one (blocks.secrets); elsewhere call "
            "rollart.storage.s3.install_credentials_resolver(fn)")
    value = _resolver(name)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            key, _, secret = value.partition(":")
            value = {"aws_access_key_id": key, "aws_secret_access_key": secret}
    if not isinstance(value, dict) or not value.get("aws_access_key_id") or not value.get(
            "aws_secret_access_key"):
        raise StorageError(
            f"storage: Prefect Secret block {name!r} must hold aws_access_key_id and "
            "aws_secret_access_key"
        )
    return (str(value["aws_access_key_id"]), str(value["aws_secret_access_key"]),
            value.get("aws_session_token"))


def storage_options(cfg: StorageConfig) -> dict[str, Any]:
    """fsspec options for `cfg.root` (empty for local paths). Secrets stay in memory only."""
    if not is_s3(cfg.root):
        return {}
    client_kwargs: dict[str, Any] = {}
    if cfg.region:
        client_kwargs["region_name"] = cfg.region
    opts: dict[str, Any] = {
        "use_listings_cache": False,  # other processes write: never trust a cached listing
        "client_kwargs": client_kwargs,
        # botocore's own retries for single requests; `retrying` covers longer outages.
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                          "connect_timeout": 5, "read_timeout": 60},
        "max_concurrency": 8,
    }
    if cfg.endpoint_url:
        opts["endpoint_url"] = cfg.endpoint_url.rstrip("/")
    if cfg.profile:
        opts["profile"] = cfg.profile
    held = None
    if cfg.credentials_block:
        held = _block_credentials(cfg.credentials_block)
    elif not cfg.profile:  # keys this process holds out of its environment (rollart.secrets)
        from rollart import secrets

        held = secrets.storage_keys()
    if held is not None:
        key, secret, token = held
        opts.update(key=key, secret=secret)
        if token:
            opts["token"] = token
    return opts


def split_s3(root: str) -> tuple[str, str]:
    """`s3://bucket/prefix/` -> ("bucket", "prefix")."""
    rest = root.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def _describe(cfg: StorageConfig) -> str:
    return f"{cfg.root} at {cfg.endpoint_url or 'AWS S3'}"


def check_storage(cfg: StorageConfig, timeout_s: float = 15.0) -> str:
    """Fail fast, with one line, when the store cannot be used: unreachable endpoint, missing or
    wrong credentials, missing bucket (created when `create_bucket`), no write permission.
    Writes and deletes one small probe object. Returns a short description of the store."""
    if not is_s3(cfg.root):
        import fsspec

        fs, path = fsspec.core.url_to_fs(cfg.root)
        try:
            fs.makedirs(path, exist_ok=True)
        except OSError as err:
            raise StorageError(f"storage: cannot create {cfg.root}: {_one_line(err)}") from err
        return f"local directory {path}"
    import s3fs

    try:
        opts = storage_options(cfg)
    except StorageError:
        raise
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **{
        **opts, "config_kwargs": {**opts["config_kwargs"], "retries": {"max_attempts": 1}}})
    bucket, prefix = split_s3(cfg.root)
    probe = f"{bucket}/{prefix + '/' if prefix else ''}.rollart-probe-{random.getrandbits(32):08x}"

    def attempt() -> None:
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            if not cfg.create_bucket:
                raise StorageError(
                    f"storage: bucket {bucket!r} does not exist at "
                    f"{cfg.endpoint_url or 'AWS S3'}; create it or set storage.create_bucket=true"
                ) from None
            kw: dict[str, Any] = {}
            region = cfg.region or fs.client_kwargs.get("region_name")
            if region and region != "us-east-1" and not cfg.endpoint_url:
                kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
            fs.call_s3("create_bucket", Bucket=bucket, **kw)
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)

    try:
        retrying(attempt, f"reaching {_describe(cfg)}", timeout_s=timeout_s, max_s=2.0)
    except StorageError:
        raise
    except PermissionError as err:
        raise StorageError(
            f"storage: S3 rejected the credentials for {_describe(cfg)} ({_one_line(err)}); "
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            + (f" in Prefect Secret block {cfg.credentials_block!r}" if cfg.credentials_block
               else " (or storage.profile / storage.credentials_block)")
        ) from None
    except Exception as err:
        name = type(err).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            raise StorageError(
                f"storage: no S3 credentials for {_describe(cfg)}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, storage.profile or storage.credentials_block"
            ) from None
        raise StorageError(
            f"storage: cannot use {_describe(cfg)}: {name}: {_one_line(err)}") from None
    return f"S3 {cfg.root} at {cfg.endpoint_url or 'AWS'}"
