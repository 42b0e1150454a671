"""Control-plane calls of the local Lambda endpoint (the subset `rollart lambda deploy` uses).

A mixin over `LocalLambda`'s state (functions, lock, temp root). Every method takes the parsed
request and returns (HTTP status, JSON-able body); errors are `ApiError`s, which the HTTP layer
turns into AWS-style errors (`x-amzn-ErrorType` header + JSON body) that boto3 raises as
`ResourceNotFoundException`, `ResourceConflictException`, ...
"""

from __future__ import annotations

import base64
import re
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from infra.lambda_functions import (
    ApiError,
    Function,
    FunctionSpec,
    Version,
    check_env,
    check_handler,
    check_limits,
    check_name,
    code_identity,
    resolve_handler,
    split_name,
    unpack_zip,
)
from infra.lambda_runtime_worker import VersionSpec

Reply = tuple[int, Any]
FN = r"/(?P<fn>[^/]+)"
# What `POST /local/functions` may set: a name, a packaged reward, limits and the environment
# every other path allows (check_env); never code_dir, which would run code from outside the
# project.
REGISTER_FIELDS = {"name", "handler", "concurrency", "timeout_s", "memory_mb", "env"}


class ControlPlane:
    _functions: dict[str, Function]
    _lock: threading.Lock
    _root: Path
    region: str
    default_concurrency: int

    def metrics(self) -> dict[str, Any]:  # provided by LocalLambda
        raise NotImplementedError

    def _function(self, raw: str) -> Function:
        name, _ = split_name(raw, None)
        fn = self._functions.get(name)
        if fn is None:
            raise ApiError(404, "ResourceNotFoundException",
                           f"Function not found: arn:aws:lambda:{self.region}:000000000000:"
                           f"function:{name}")
        return fn

    def _unpack(self, name: str, zip_b64: str | None) -> tuple[str, str, int]:
        if not zip_b64:
            raise ApiError(400, "InvalidParameterValueException",
                           "only Code.ZipFile is supported by the local endpoint (no S3/images)")
        try:
            data = base64.b64decode(zip_b64, validate=True)
        except ValueError:
            raise ApiError(400, "InvalidParameterValueException",
                           "Code.ZipFile is not base64") from None
        dest = self._root / "code" / name / uuid.uuid4().hex[:12]
        dest.mkdir(parents=True)
        unpack_zip(data, dest)
        sha, size = code_identity(data)
        return str(dest), sha, size

    def register(self, spec: FunctionSpec) -> Function:
        """Config-registered function (no zip): runs from this project's import path."""
        check_name(spec.name)
        vspec = VersionSpec(spec.name, "$LATEST", resolve_handler(spec.handler), spec.timeout_s,
                            spec.memory_mb, check_env(spec.env), spec.code_dir)
        with self._lock:
            fn = Function(Version(vspec), spec.concurrency, self.region)
            old = self._functions.get(spec.name)
            if old is not None:
                fn.in_flight = old.in_flight
            self._functions[spec.name] = fn
        return fn

    def register_packaged(self, req: dict[str, Any]) -> Reply:
        """`POST /local/functions` (signed): a function running one of the project's built-in
        reward handlers from the project itself. A name already taken keeps its handler
        (change it with UpdateFunctionConfiguration, as on AWS)."""
        from rollart.rewards.registry import BUILTINS

        bad = sorted(set(req) - REGISTER_FIELDS)
        if bad:
            raise ApiError(400, "InvalidParameterValueException",
                           f"unsupported field(s) {', '.join(bad)}: only the project's packaged "
                           "reward handlers can be registered (name, handler, concurrency, "
                           "timeout_s, memory_mb, env)")
        handler = str(req.get("handler", ""))
        if handler not in BUILTINS and handler not in BUILTINS.values():
            raise ApiError(400, "InvalidParameterValueException",
                           f"handler {handler!r} is not a packaged reward handler "
                           f"({', '.join(BUILTINS)})")
        timeout, memory = check_limits(req.get("timeout_s", 30.0), req.get("memory_mb", 512))
        try:
            concurrency = int(req.get("concurrency", self.default_concurrency))
        except (TypeError, ValueError):
            concurrency = 0
        if not 1 <= concurrency <= 1000:
            raise ApiError(400, "InvalidParameterValueException", "concurrency 1..1000")
        spec = FunctionSpec(str(req.get("name", "")), handler, concurrency=concurrency,
                            timeout_s=timeout, memory_mb=memory, env=check_env(req.get("env")))
        with self._lock:
            old = self._functions.get(spec.name)
            if old is not None and old.latest.spec.handler != resolve_handler(handler):
                raise ApiError(409, "ResourceConflictException",
                               f"Function already exist: {spec.name}")
        fn = self.register(spec)
        return 201, fn.configuration(fn.latest)

    def create_function(self, req: dict[str, Any]) -> Reply:
        name = str(req.get("FunctionName", ""))
        check_name(name)
        if not req.get("Handler"):
            raise ApiError(400, "InvalidParameterValueException", "Handler is required")
        check_handler(str(req["Handler"]))
        env = check_env(_variables(req))  # before the zip is unpacked: nothing left behind
        timeout, memory = check_limits(req.get("Timeout", 3), req.get("MemorySize", 128))
        code_dir, sha, size = self._unpack(name, (req.get("Code") or {}).get("ZipFile"))
        vspec = VersionSpec(name, "$LATEST", req["Handler"], timeout, memory, env, code_dir)
        latest = Version(vspec, sha, size, req.get("Runtime", "python3.11"),
                         req.get("Role", Version.role), req.get("Description", ""))
        with self._lock:
            if name in self._functions:
                raise ApiError(409, "ResourceConflictException", f"Function already exist: {name}")
            fn = Function(latest, self.default_concurrency, self.region)
            self._functions[name] = fn
            v = fn.publish() if req.get("Publish") else fn.latest
            return 201, fn.configuration(v)

    def get_function(self, raw: str, qualifier: str | None) -> Reply:
        with self._lock:
            fn = self._function(raw)
            v = fn.resolve(split_name(raw, qualifier)[1])
            out: dict[str, Any] = {"Configuration": fn.configuration(v),
                                   "Code": {"RepositoryType": "S3", "Location": v.spec.code_dir}}
            if fn.reserved is not None:
                out["Concurrency"] = {"ReservedConcurrentExecutions": fn.reserved}
            return 200, out

    def get_configuration(self, raw: str, qualifier: str | None) -> Reply:
        with self._lock:
            fn = self._function(raw)
            return 200, fn.configuration(fn.resolve(split_name(raw, qualifier)[1]))

    def list_functions(self) -> Reply:
        with self._lock:
            return 200, {"Functions": [f.configuration(f.latest)
                                       for f in self._functions.values()]}

    def delete_function(self, raw: str) -> Reply:
        with self._lock:
            fn = self._function(raw)
            del self._functions[fn.name]  # its pools are no longer current: the reaper drains
            return 204, None

    def update_code(self, raw: str, req: dict[str, Any]) -> Reply:
        fn = self._function(raw)
        code_dir, sha, size = self._unpack(fn.name, req.get("ZipFile"))
        with self._lock:
            fn.update_latest(code_dir=code_dir, code_sha256=sha, code_size=size)
            v = fn.publish() if req.get("Publish") else fn.latest
            return 200, fn.configuration(v)

    def update_configuration(self, raw: str, req: dict[str, Any]) -> Reply:
        with self._lock:
            fn = self._function(raw)
            changes: dict[str, Any] = {}
            if "Handler" in req:
                check_handler(str(req["Handler"]))
                changes["handler"] = req["Handler"]
            if "Timeout" in req or "MemorySize" in req:
                changes["timeout_s"], changes["memory_mb"] = check_limits(
                    req.get("Timeout", fn.latest.spec.timeout_s),
                    req.get("MemorySize", fn.latest.spec.memory_mb))
            if "Environment" in req:
                changes["env"] = check_env(_variables(req))
            if "Description" in req:
                changes["description"] = req["Description"]
            fn.update_latest(**changes)
            return 200, fn.configuration(fn.latest)

    def publish_version(self, raw: str, req: dict[str, Any]) -> Reply:
        with self._lock:
            fn = self._function(raw)
            want = req.get("CodeSha256")
            if want and want != fn.latest.code_sha256:
                raise ApiError(412, "PreconditionFailedException",
                               "CodeSha256 does not match the function's current code")
            return 201, fn.configuration(fn.publish(req.get("Description", "")))

    def create_alias(self, raw: str, req: dict[str, Any]) -> Reply:
        with self._lock:
            fn = self._function(raw)
            if req.get("Name") in fn.aliases:
                raise ApiError(409, "ResourceConflictException",
                               f"Alias already exists: {fn.arn(req['Name'])}")
            return 201, fn.set_alias(str(req.get("Name")), str(req.get("FunctionVersion")),
                                     req.get("Description", ""))

    def alias(self, method: str, raw: str, alias: str, req: dict[str, Any]) -> Reply:
        with self._lock:
            fn = self._function(raw)
            if alias not in fn.aliases:
                raise ApiError(404, "ResourceNotFoundException",
                               f"Alias not found: {fn.arn(alias)}")
            if method == "GET":
                return 200, fn.alias_json(alias)
            if method == "DELETE":
                del fn.aliases[alias]
                return 204, None
            cur = fn.aliases[alias]
            return 200, fn.set_alias(alias, str(req.get("FunctionVersion",
                                                        cur["FunctionVersion"])),
                                     req.get("Description", cur.get("Description", "")))

    def concurrency(self, method: str, raw: str, req: dict[str, Any]) -> Reply:
        with self._lock:
            fn = self._function(raw)
            if method == "PUT":
                n = int(req.get("ReservedConcurrentExecutions", -1))
                if n < 0:
                    raise ApiError(400, "InvalidParameterValueException",
                                   "ReservedConcurrentExecutions must be >= 0")
                fn.reserved = n
            elif method == "DELETE":
                fn.reserved = None
                return 204, None
            return 200, ({} if fn.reserved is None
                         else {"ReservedConcurrentExecutions": fn.reserved})

    def control(self, method: str, path: str, qual: str | None, req: dict[str, Any]) -> Reply:
        """Route one control-plane request (paths as in botocore's Lambda service model)."""
        if re.fullmatch(r"/2015-03-31/functions/?", path):
            return self.create_function(req) if method == "POST" else self.list_functions()
        if m := re.fullmatch(f"/20[0-9-]+/functions{FN}(?P<rest>/.*)?", path):
            fn, rest = unquote(m["fn"]), m["rest"] or ""
            if rest == "" and method == "GET":
                return self.get_function(fn, qual)
            if rest == "" and method == "DELETE":
                return self.delete_function(fn)
            if rest == "/configuration":
                return (self.update_configuration(fn, req) if method == "PUT"
                        else self.get_configuration(fn, qual))
            if rest == "/code" and method == "PUT":
                return self.update_code(fn, req)
            if rest == "/versions" and method == "POST":
                return self.publish_version(fn, req)
            if rest == "/aliases" and method == "POST":
                return self.create_alias(fn, req)
            if rest.startswith("/aliases/"):
                return self.alias(method, fn, unquote(rest.removeprefix("/aliases/")), req)
            if rest == "/concurrency":
                return self.concurrency(method, fn, req)
        if path == "/local/metrics" and method == "GET":
            return 200, self.metrics()
        if path == "/local/functions" and method == "POST":
            return self.register_packaged(req)
        raise ApiError(404, "UnknownOperationException", f"{method} {path}")


def _variables(req: dict[str, Any]) -> Any:
    """`Environment.Variables` of a CreateFunction / UpdateFunctionConfiguration request."""
    env = req.get("Environment") or {}
    if not isinstance(env, dict):
        raise ApiError(400, "InvalidParameterValueException", "Environment must be an object")
    return env.get("Variables")
