"""`rollart lambda package|deploy`: reward handlers as AWS Lambda functions.

Credentials come from the environment (AWS_ACCESS_KEY_ID/..., AWS_PROFILE), never from flags or
config. `--endpoint-url http://127.0.0.1:PORT` targets the local endpoint
(`python -m infra.lambda_endpoint`) instead of AWS; it requires signed requests too: the key
pair from ROLLART_LAMBDA_ACCESS_KEY_ID/ROLLART_LAMBDA_SECRET_ACCESS_KEY, else the one `rollart up`
keeps in the state directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Package and deploy reward functions to AWS Lambda (or the local "
                       "endpoint).")


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


@app.command()
def package(
    out: Path = typer.Option(Path("dist/rollart-rewards.zip"), "--out", "-o"),
    no_deps: bool = typer.Option(False, "--no-deps", help="Handler code only, no pip install"),
    requirement: list[str] = typer.Option([], "--requirement", "-r",
                                          help="pip requirement (repeatable; default "
                                               "math-verify)"),
    platform: str = typer.Option(None, "--platform",
                                 help="Wheel platform, e.g. manylinux2014_x86_64 (Lambda)"),
    python_version: str = typer.Option("3.11", "--python-version"),
) -> None:
    """Build the deployment zip: rollart/rewards + its pure-Python dependencies."""
    from infra.lambda_package import build_package

    try:
        pkg = build_package(out, requirements=requirement or None, no_deps=no_deps,
                            platform=platform, python_version=python_version)
    except RuntimeError as err:
        _fail(str(err), 1)
    typer.echo(f"{pkg.path} ({pkg.size / 1e6:.1f} MB, {len(pkg.files)} files, "
               f"CodeSha256 {pkg.code_sha256})")


@app.command()
def deploy(
    function_name: str = typer.Option(..., "--function-name", "-f", help="Lambda function"),
    handler: str = typer.Option("env_outcome", "--handler",
                                help="Reward name (env_outcome, math, ...) or module.function"),
    zip_path: Path = typer.Option(None, "--zip", help="Existing package (default: build one)"),
    alias: str = typer.Option("live", "--alias"),
    concurrency: int = typer.Option(None, "--concurrency", help="Reserved concurrency"),
    timeout: int = typer.Option(30, "--timeout", help="Function timeout, seconds"),
    memory: int = typer.Option(512, "--memory", help="Memory, MB"),
    env: list[str] = typer.Option([], "--env", help="KEY=VALUE for the function (repeatable)"),
    role: str = typer.Option(None, "--role", envvar="ROLLART_LAMBDA_ROLE",
                             help="IAM role ARN the function runs as (required on AWS)"),
    runtime: str = typer.Option("python3.11", "--runtime"),
    endpoint_url: str = typer.Option(None, "--endpoint-url",
                                     help="Local endpoint URL; unset for real AWS"),
    region: str = typer.Option("us-east-1", "--region", envvar="AWS_REGION"),
    no_deps: bool = typer.Option(False, "--no-deps"),
    platform: str = typer.Option(None, "--platform"),
    state_dir: Path = typer.Option(None, "--state-dir", envvar="ROLLART_STATE_DIR",
                                   help="Stack state directory (local endpoint's key pair)"),
) -> None:
    """Create or update the function, publish a version, move the alias, set concurrency."""
    from botocore.exceptions import BotoCoreError, ClientError

    from infra.lambda_package import build_package
    from infra.lambda_package import deploy as do_deploy
    from infra.stack import default_state_dir
    from infra.state import lambda_credentials
    from rollart.rewards.client import LambdaCredentials, RewardError, is_loopback

    bad = [e for e in env if "=" not in e]
    if bad:
        _fail(f"--env takes KEY=VALUE, got {bad[0]!r}")
    if endpoint_url is None and role is None:
        _fail("deploying to AWS needs --role (or ROLLART_LAMBDA_ROLE); for the local endpoint "
              "pass --endpoint-url")
    creds = None
    if is_loopback(endpoint_url) and LambdaCredentials.from_env() is None:
        creds = lambda_credentials(state_dir or default_state_dir(), create=False)
    try:
        if zip_path is None:
            zip_path = build_package(Path("dist/rollart-rewards.zip"), no_deps=no_deps,
                                     platform=platform).path
        out = do_deploy(zip_path, function_name, handler, alias=alias,
                        reserved_concurrency=concurrency, timeout_s=timeout, memory_mb=memory,
                        env=dict(e.split("=", 1) for e in env), role=role, runtime=runtime,
                        endpoint_url=endpoint_url, region=region, credentials=creds)
    except RewardError as err:  # no key pair for the local endpoint
        _fail(str(err))
    except (ClientError, BotoCoreError, ValueError, KeyError, RuntimeError) as err:
        _fail(f"deploy of {function_name!r} failed: {err}", 1)
    typer.echo(json.dumps(out, indent=2))
