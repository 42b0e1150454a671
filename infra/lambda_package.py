"""Package reward handlers as a Lambda deployment zip and deploy them with boto3.

`build_package` zips `rollart/rewards` (the handlers; not the clients, which need the rest of
rollart) under `rollart/`, plus the handlers' pure-Python dependencies installed with
`pip install --target` (math-verify -> sympy, latex2sympy2, antlr4). The zip is deterministic
(sorted entries, fixed timestamps), so an unchanged build has an unchanged CodeSha256 and
`deploy` skips the code upload.

`deploy`: create or update the function, wait until it is Active/Successful, publish a version,
point an alias at it, set reserved concurrency. The same calls go to real AWS (credentials from
the environment or a profile, `role` required) or to the local endpoint (`endpoint_url`).
torch/transformers (the model-based reward) are far over Lambda's 250 MB zip limit: deploy that
one as a container image; this zip carries the others.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.lambda_functions import code_identity, resolve_handler
from rollart.rewards.client import LambdaCredentials, signing_credentials

REWARDS_DIR = Path(__file__).resolve().parents[1] / "rollart" / "rewards"
DEFAULT_REQUIREMENTS = ("math-verify>=0.7",)
SKIP_FILES = {"client.py"}  # needs rollart.types/boto3; a handler never imports it
DIRECT_UPLOAD_LIMIT = 50 * 1024 * 1024  # Lambda's limit for Code.ZipFile
LOCAL_ROLE = "arn:aws:iam::000000000000:role/rollart-local"


@dataclass
class Package:
    path: Path
    code_sha256: str
    size: int
    files: list[str]


def _pip_target(requirements: list[str], target: Path, platform: str | None,
                python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
           "--disable-pip-version-check", "--target", str(target), *requirements]
    if platform:  # e.g. manylinux2014_x86_64: wheels for Lambda's OS, not this machine's
        cmd += ["--platform", platform, "--only-binary=:all:", "--implementation", "cp",
                "--python-version", python_version]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install --target failed ({proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")


def _entries(root: Path, prefix: str = "") -> list[tuple[str, Path]]:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_dir() or "__pycache__" in rel.parts or p.suffix == ".pyc":
            continue
        out.append((prefix + rel.as_posix(), p))
    return out


def build_package(out: Path, *, requirements: list[str] | None = None, no_deps: bool = False,
                  platform: str | None = None, python_version: str = "3.11") -> Package:
    """Build the deployment zip at `out`. `no_deps`: only the handler code (fast; tests)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries = [("rollart/__init__.py", REWARDS_DIR.parent / "__init__.py")]
    entries += [(f"rollart/rewards/{p.name}", p) for p in sorted(REWARDS_DIR.glob("*.py"))
                if p.name not in SKIP_FILES]
    with tempfile.TemporaryDirectory(prefix="rollart-pkg-") as tmp:
        if not no_deps:
            reqs = list(requirements) if requirements else list(DEFAULT_REQUIREMENTS)
            _pip_target(reqs, Path(tmp), platform, python_version)
            entries += [e for e in _entries(Path(tmp)) if not e[0].startswith("bin/")]
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for name, path in sorted(entries):
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16  # readable by Lambda's sandbox user
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
    sha, size = code_identity(out.read_bytes())
    return Package(out, sha, size, [name for name, _ in sorted(entries)])


def lambda_client(endpoint_url: str | None, region: str,
                  credentials: LambdaCredentials | None = None) -> Any:
    """Control-plane client: botocore's standard retries (control calls get throttled too).
    Signed like every client: the local endpoint's key pair for a loopback `endpoint_url`."""
    import boto3
    from botocore.config import Config

    opts: dict[str, Any] = {"retries": {"mode": "standard", "max_attempts": 5},
                            "read_timeout": 120}
    return boto3.client("lambda", region_name=region, endpoint_url=endpoint_url,
                        config=Config(**opts), **signing_credentials(endpoint_url, credentials))


def deploy(zip_path: Path, function_name: str, handler: str, *, alias: str = "live",
           reserved_concurrency: int | None = None, timeout_s: int = 30, memory_mb: int = 512,
           env: dict[str, str] | None = None, role: str | None = None,
           runtime: str = "python3.11", endpoint_url: str | None = None,
           region: str = "us-east-1", client: Any = None, wait_delay_s: int = 1,
           credentials: LambdaCredentials | None = None) -> dict[str, Any]:
    """Create or update `function_name` from `zip_path`; publish; alias; reserved concurrency."""
    data = Path(zip_path).read_bytes()
    if len(data) > DIRECT_UPLOAD_LIMIT:
        raise ValueError(f"{zip_path} is {len(data) >> 20} MB; Lambda takes at most 50 MB "
                         "directly: trim dependencies or upload through S3")
    if role is None and endpoint_url is None:
        raise ValueError("deploying to AWS needs --role (the IAM role ARN the function runs as)")
    lam = client or lambda_client(endpoint_url, region, credentials)
    sha, size = code_identity(data)
    config = {"Handler": resolve_handler(handler), "Timeout": int(timeout_s),
              "MemorySize": int(memory_mb), "Runtime": runtime,
              "Environment": {"Variables": dict(env or {})}}
    waiter_cfg = {"Delay": wait_delay_s, "MaxAttempts": 300}
    try:
        current = lam.get_function(FunctionName=function_name)["Configuration"]
    except lam.exceptions.ResourceNotFoundException:
        current = None
    if current is None:
        lam.create_function(FunctionName=function_name, Role=role or LOCAL_ROLE,
                            Code={"ZipFile": data}, Publish=False, PackageType="Zip",
                            **config)
        lam.get_waiter("function_active_v2").wait(FunctionName=function_name,
                                                  WaiterConfig=waiter_cfg)
        code_changed = True
    else:
        code_changed = current.get("CodeSha256") != sha
        if code_changed:
            lam.update_function_code(FunctionName=function_name, ZipFile=data)
            lam.get_waiter("function_updated_v2").wait(FunctionName=function_name,
                                                       WaiterConfig=waiter_cfg)
        have = {"Handler": current.get("Handler"), "Timeout": current.get("Timeout"),
                "MemorySize": current.get("MemorySize"), "Runtime": current.get("Runtime"),
                "Environment": {"Variables": (current.get("Environment") or {}).get(
                    "Variables", {})}}
        if have != config:
            lam.update_function_configuration(FunctionName=function_name, **config)
            lam.get_waiter("function_updated_v2").wait(FunctionName=function_name,
                                                       WaiterConfig=waiter_cfg)
    version = lam.publish_version(FunctionName=function_name, CodeSha256=sha)["Version"]
    lam.get_waiter("published_version_active").wait(FunctionName=function_name,
                                                    Qualifier=version, WaiterConfig=waiter_cfg)
    try:
        lam.get_alias(FunctionName=function_name, Name=alias)
        alias_cfg = lam.update_alias(FunctionName=function_name, Name=alias,
                                     FunctionVersion=version)
    except lam.exceptions.ResourceNotFoundException:
        alias_cfg = lam.create_alias(FunctionName=function_name, Name=alias,
                                     FunctionVersion=version)
    if reserved_concurrency is not None:
        lam.put_function_concurrency(FunctionName=function_name,
                                     ReservedConcurrentExecutions=int(reserved_concurrency))
    return {"function_name": function_name, "handler": config["Handler"], "version": version,
            "alias": alias, "alias_arn": alias_cfg["AliasArn"], "code_sha256": sha,
            "code_size": size, "code_updated": code_changed,
            "reserved_concurrency": reserved_concurrency}
