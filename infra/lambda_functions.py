"""Function registry of the local Lambda endpoint: versions, aliases, code, API shapes.

Implements the state behind the control-plane calls `rollart lambda deploy` makes (CreateFunction,
GetFunction, UpdateFunctionCode/Configuration, PublishVersion, Create/Get/UpdateAlias,
Put/GetFunctionConcurrency) with the JSON shapes boto3 parses. Deployed zips are unpacked into the
endpoint's temp dir and run from there, exactly as Lambda runs /var/task.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import re
import uuid
import zipfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infra.lambda_runtime_worker import VersionSpec

ACCOUNT = "000000000000"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
UNZIPPED_LIMIT = 250 * 1024 * 1024  # Lambda's limit for an unpacked deployment package
# Files the interpreter runs on start-up from any sys.path entry: never from a package.
STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py")
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
# The only environment a function may have on the local endpoint, however it is set
# (`POST /local/functions`, CreateFunction, UpdateFunctionConfiguration, a FunctionSpec):
# threading and offline knobs, each value matching its pattern. Anything else runs code of the
# caller's choosing as the endpoint's user (root in the stack) before any handler: PYTHONPATH
# to a `sitecustomize`, LD_PRELOAD, PYTHONSTARTUP, PYTHONHOME; or weakens a handler
# (ROLLART_SANDBOX_ALLOW_WEAK is the operator's, never a request's).
FUNCTION_ENV = {
    "OMP_NUM_THREADS": r"[1-9][0-9]{0,2}", "MKL_NUM_THREADS": r"[1-9][0-9]{0,2}",
    "TOKENIZERS_PARALLELISM": r"true|false", "HF_HUB_OFFLINE": r"[01]",
    "TRANSFORMERS_OFFLINE": r"[01]",
}


class ApiError(Exception):
    """An AWS-style error: HTTP status, error code (x-amzn-ErrorType), message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class FunctionSpec:
    """A function registered by config (constructor or CLI) rather than by CreateFunction."""

    name: str
    handler: str  # "module.function" (awslambdaric), or a rollart reward name: "env_outcome"
    concurrency: int = 8  # reserved concurrency: invocations in flight above it get 429
    timeout_s: float = 30.0
    memory_mb: int = 512
    env: dict[str, str] = field(default_factory=dict)
    code_dir: str | None = None  # None: run from this project's import path


def resolve_handler(handler: str) -> str:
    """Short rollart reward names ("env_outcome") -> the module.function awslambdaric imports."""
    if "." in handler:
        return handler
    from rollart.rewards.registry import handler_path

    return handler_path(handler)


def split_name(raw: str, qualifier: str | None) -> tuple[str, str | None]:
    """`name`, `name:alias`, or a (partial) ARN with an optional qualifier -> (name, qualifier)."""
    parts = raw.split(":")
    if raw.startswith("arn:"):
        name, qual = parts[6] if len(parts) > 6 else "", parts[7] if len(parts) > 7 else None
    elif len(parts) >= 3 and parts[1] == "function":  # 123456789012:function:name[:qual]
        name, qual = parts[2], parts[3] if len(parts) > 3 else None
    else:
        name, qual = parts[0], parts[1] if len(parts) > 1 else None
    return name, qualifier or qual


def check_env(variables: Any) -> dict[str, str]:
    """A function's environment, if every name and value is allowed (FUNCTION_ENV); else 400
    naming the first that is not. The one gate for every way to set it."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise ApiError(400, "InvalidParameterValueException",
                       "Environment.Variables must be a map of names to strings")
    for name, value in variables.items():
        pattern = FUNCTION_ENV.get(name)
        if pattern is None:
            raise ApiError(400, "InvalidParameterValueException",
                           f"environment variable {str(name)[:64]!r} is not allowed on the "
                           f"local endpoint (allowed: {', '.join(sorted(FUNCTION_ENV))})")
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            raise ApiError(400, "InvalidParameterValueException",
                           f"environment variable {name} must match {pattern}")
    return dict(variables)


def check_limits(timeout_s: Any, memory_mb: Any) -> tuple[float, int]:
    """Lambda's bounds: timeout (0, 900] s, memory 128..10240 MB (a worker's memory limit)."""
    try:
        timeout, memory = float(timeout_s), int(memory_mb)
    except (TypeError, ValueError):
        raise ApiError(400, "InvalidParameterValueException",
                       "timeout and memory size must be numbers") from None
    if not (0 < timeout <= 900 and 128 <= memory <= 10240):
        raise ApiError(400, "InvalidParameterValueException",
                       "timeout (0, 900] seconds, memory size 128..10240 MB")
    return timeout, memory


def check_handler(handler: str) -> None:
    """Deployed functions run this project's reward handlers (rollart.rewards.*) only."""
    if not handler.startswith("rollart.rewards.") or not all(
            part.isidentifier() for part in handler.split(".")):
        raise ApiError(400, "InvalidParameterValueException",
                       f"Handler {handler!r} is not one of this project's reward handlers "
                       "(rollart.rewards.<module>.<function>)")


def _bad_zip(message: str) -> ApiError:
    return ApiError(400, "InvalidParameterValueException", message)


def check_packaged(zf: zipfile.ZipFile) -> None:
    """A deployment zip must carry this project's rollart/ files unchanged (what
    infra/lambda_package.py builds), and nothing Python would run on start-up by itself."""
    infos = zf.infolist()
    if sum(i.file_size for i in infos) > UNZIPPED_LIMIT:
        raise _bad_zip(f"unzipped size exceeds {UNZIPPED_LIMIT} bytes")
    for info in infos:
        name = info.filename
        if name.split("/")[0] in STARTUP_HOOKS or name.endswith(".pth"):
            raise _bad_zip(f"zip entry {name} would run on interpreter start-up")
        if name.startswith("rollart/") and not info.is_dir():
            if ".." in name.split("/"):
                raise _bad_zip(f"zip entry {name} leaves the package")
            ours = PROJECT_ROOT / name
            if not ours.is_file() or ours.read_bytes() != zf.read(info):
                raise _bad_zip(f"zip entry {name} is not this project's packaged code "
                               "(rebuild with `rollart lambda package`)")


def unpack_zip(data: bytes, dest: Path) -> None:
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise _bad_zip("Code.ZipFile is not a zip archive") from None
    with zf:
        root = dest.resolve()
        for info in zf.infolist():  # zip-slip first: check_packaged opens files by entry name
            if not (dest / info.filename).resolve().is_relative_to(root):
                raise ApiError(400, "InvalidParameterValueException",
                               f"zip entry escapes the code dir: {info.filename}")
        check_packaged(zf)
        zf.extractall(dest)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+0000"


@dataclass
class Version:
    spec: VersionSpec
    code_sha256: str = ""
    code_size: int = 0
    runtime: str = "python3.11"
    role: str = f"arn:aws:iam::{ACCOUNT}:role/rollart-local"
    description: str = ""
    last_modified: str = field(default_factory=_now)


class Function:
    def __init__(self, latest: Version, concurrency: int, region: str) -> None:
        self.name = latest.spec.function
        self.latest = latest
        self.versions: dict[str, Version] = {}
        self.aliases: dict[str, dict[str, Any]] = {}
        self.concurrency = concurrency
        self.reserved: int | None = None  # set by PutFunctionConcurrency
        self.in_flight = 0
        self.region = region

    def arn(self, qualifier: str | None = None) -> str:
        base = f"arn:aws:lambda:{self.region}:{ACCOUNT}:function:{self.name}"
        return f"{base}:{qualifier}" if qualifier else base

    def resolve(self, qualifier: str | None) -> Version:
        if qualifier in (None, "", "$LATEST"):
            return self.latest
        if qualifier in self.versions:
            return self.versions[qualifier]
        if qualifier in self.aliases:
            return self.resolve(self.aliases[qualifier]["FunctionVersion"])
        raise ApiError(404, "ResourceNotFoundException",
                       f"Function not found: {self.arn(qualifier)}")

    def update_latest(self, **changes: Any) -> None:
        """New code or configuration: a new revision, so new workers (old ones drain)."""
        fields = VersionSpec.__annotations__
        spec_changes = {k: changes.pop(k) for k in list(changes) if k in fields}
        spec = replace(self.latest.spec, revision=uuid.uuid4().hex, **spec_changes)
        self.latest = replace(self.latest, spec=spec, last_modified=_now(), **changes)

    def publish(self, description: str = "") -> Version:
        for v in self.versions.values():  # Lambda returns the existing version if unchanged
            if v.code_sha256 == self.latest.code_sha256 and v.spec.handler == \
                    self.latest.spec.handler and v.spec.env == self.latest.spec.env and \
                    v.spec.timeout_s == self.latest.spec.timeout_s:
                return v
        number = str(len(self.versions) + 1)
        spec = replace(self.latest.spec, version=number, revision=uuid.uuid4().hex)
        self.versions[number] = replace(self.latest, spec=spec, description=description)
        return self.versions[number]

    def configuration(self, v: Version) -> dict[str, Any]:
        s = v.spec
        return {
            "FunctionName": self.name,
            "FunctionArn": self.arn(None if s.version == "$LATEST" else s.version),
            "Runtime": v.runtime, "Role": v.role, "Handler": s.handler,
            "CodeSize": v.code_size, "Description": v.description,
            "Timeout": max(1, math.ceil(s.timeout_s)), "MemorySize": s.memory_mb,
            "LastModified": v.last_modified, "CodeSha256": v.code_sha256,
            "Version": s.version, "Environment": {"Variables": dict(s.env)},
            "RevisionId": s.revision, "State": "Active", "LastUpdateStatus": "Successful",
            "PackageType": "Zip", "Architectures": ["x86_64"],
        }

    def alias_json(self, name: str) -> dict[str, Any]:
        a = self.aliases[name]
        return {"AliasArn": self.arn(name), "Name": name, "FunctionVersion": a["FunctionVersion"],
                "Description": a.get("Description", ""), "RevisionId": a["RevisionId"]}

    def set_alias(self, name: str, version: str, description: str = "") -> dict[str, Any]:
        if version != "$LATEST" and version not in self.versions:
            raise ApiError(404, "ResourceNotFoundException",
                           f"Function version {version} not found: {self.arn(version)}")
        self.aliases[name] = {"FunctionVersion": version, "Description": description,
                              "RevisionId": uuid.uuid4().hex}
        return self.alias_json(name)

    def limit(self) -> int:
        return self.reserved if self.reserved is not None else self.concurrency


def code_identity(data: bytes) -> tuple[str, int]:
    """(CodeSha256, CodeSize) as Lambda reports them: base64 of the zip's SHA-256."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode(), len(data)


def check_name(name: str) -> None:
    if not name or len(name) > 64 or not set(name) <= NAME_CHARS:
        raise ApiError(400, "InvalidParameterValueException",
                       f"invalid function name {name!r}")
