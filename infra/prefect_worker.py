"""The stack's Prefect worker: a process worker that checks each flow run before it runs it.

The server checks job variables against the work pool's locked template (infra/prefect_server.py
`locked_job_template`, `additionalProperties: false`) on `POST /deployments/` and on a
deployment's `create_flow_run`, but not everywhere (measured on Prefect 3.9.1, real server):
`PATCH /api/deployments/{id}` stores `job_variables.command` or `env.LD_PRELOAD` (204; checked
only when the same PATCH names `work_pool_name`), a `pull_steps` entry `run_shell_script`, an
entrypoint `/tmp/evil.py:flow`; `POST /flow_runs/` with `work_pool_name` and a SCHEDULED state
creates a run with any `job_variables`, with or without a deployment, and a worker picks it up.
Stock Prefect has no server-side hook, so the one place every run passes is the worker that
starts it. Before a run's process starts, this worker refuses (the run ends Crashed, the
message says why) a run that:

- has no deployment, or whose work pool's template is not the stack's locked one;
- has job variables (its deployment's merged with its own, as the worker renders them) that
  the locked template's schema rejects: the same validation as `POST /deployments/`;
- gets its code from anywhere but this checkout: pull steps other than
  `set_working_directory` to the project root (`run_shell_script`, `git_clone`,
  `pip_install_requirements`, any importable callable), a storage block, or an entrypoint
  outside `flows.`, unless the operator allows them: ROLLART_WORKER_ALLOW_PULL_STEPS=1 in the
  environment of `rollart up` (the worker inherits it; never a request's choice).

The job is rendered from the very objects checked. What remains: the flow run's own process
(Prefect's workspace supervisor) reads the deployment again to run its pull steps, so a PATCH
that lands in the seconds between this check and that read is not seen here; closing that needs
the run's process to get the checked deployment (a Prefect change, or a pinning wrapper).

Run as `python -m infra.prefect_worker --pool NAME [--name N] [--limit K]` (infra/stack.py).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import re
import warnings
from pathlib import Path
from typing import Any

from prefect.workers.process import ProcessWorker

from infra.prefect_server import locked_job_template

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ALLOW_PULL_STEPS_ENV = "ROLLART_WORKER_ALLOW_PULL_STEPS"
SET_WORKING_DIRECTORY = {"prefect.deployments.steps.set_working_directory",
                         "prefect.deployments.steps.utility.set_working_directory"}
ENTRYPOINT = re.compile(r"flows(\.[A-Za-z_]\w*)+:[A-Za-z_]\w*", re.ASCII)


class RunRefused(RuntimeError):
    """This worker will not start the flow run (the message says what broke the rules)."""


def merged_job_variables(deployment_vars: dict[str, Any] | None,
                         flow_run_vars: dict[str, Any] | None) -> dict[str, Any]:
    """What the worker renders from: the deployment's variables with the run's on top, `env`
    merged key by key (as prefect's `resolve_for_flow_run` does)."""
    merged = copy.deepcopy(deployment_vars or {})
    own = copy.deepcopy(flow_run_vars or {})
    if isinstance(merged.get("env"), dict) and isinstance(own.get("env"), dict):
        merged["env"].update(own.pop("env"))
    merged.update(own)
    return merged


def check_job_variables(variables: dict[str, Any]) -> None:
    """The locked template's schema, validated as the server does on `POST /deployments/`."""
    from prefect.utilities.schema_tools import ValidationError, validate

    try:
        validate(variables, copy.deepcopy(locked_job_template()["variables"]),
                 raise_on_error=True, preprocess=True, ignore_required=True)
    except ValidationError as err:
        raise RunRefused(f"job variables not allowed by the stack's work pool: {err}") from None


def check_code_source(pull_steps: list[dict[str, Any]] | None, entrypoint: str | None,
                      storage_document_id: Any, project_root: Path = PROJECT_ROOT) -> None:
    """Code from this checkout only: see the module docstring."""
    if os.environ.get(ALLOW_PULL_STEPS_ENV) == "1":
        return
    hint = f" (an operator who trusts every deployment sets {ALLOW_PULL_STEPS_ENV}=1)"
    for step in pull_steps or []:
        if isinstance(step, dict) and len(step) == 1:
            name, args = next(iter(step.items()))
        else:
            name, args = repr(step)[:80], None
        directory = args.get("directory") if isinstance(args, dict) else None
        if name not in SET_WORKING_DIRECTORY or not isinstance(directory, str) or \
                Path(directory).resolve() != project_root.resolve():
            raise RunRefused(f"pull step {name} (only set_working_directory to "
                             f"{project_root} runs here){hint}")
    if storage_document_id is not None:
        raise RunRefused(f"deployment code from a storage block{hint}")
    if not isinstance(entrypoint, str) or not ENTRYPOINT.fullmatch(entrypoint):
        raise RunRefused(f"entrypoint {str(entrypoint)[:120]!r} is not a flows.* module "
                         f"entrypoint{hint}")


def check_run(flow_run: Any, deployment: Any, base_job_template: dict[str, Any]) -> None:
    """Every rule, for one flow run about to start; RunRefused names the first broken one."""
    if deployment is None:
        raise RunRefused("flow runs without a deployment do not run on the stack's work pool")
    if base_job_template != locked_job_template():
        raise RunRefused("the work pool's job template is not the stack's locked template "
                         "(`rollart up` restores it)")
    check_job_variables(merged_job_variables(deployment.job_variables, flow_run.job_variables))
    check_code_source(deployment.pull_steps, deployment.entrypoint,
                      deployment.storage_document_id)


with warnings.catch_warnings():  # same dispatch key as ProcessWorker: expected, and harmless
    warnings.simplefilter("ignore")

    class GuardedProcessWorker(ProcessWorker):
        """A process worker that runs `check_run` before it starts anything, and starts
        exactly what it checked."""

        async def run(self, flow_run: Any, configuration: Any,
                      task_status: Any = None) -> Any:
            # Read both afresh and render the job from these same objects: the configuration
            # handed in was rendered from an earlier read (and prefect's rendering pops the
            # run's `env` out of `flow_run.job_variables`), so a PATCH in between must not
            # make the check see one thing and the process get another.
            flow_run = await self.client.read_flow_run(flow_run.id)
            deployment = None
            if flow_run.deployment_id:
                deployment = await self.client.read_deployment(flow_run.deployment_id)
            pool = copy.deepcopy(self.work_pool)
            try:
                check_run(flow_run, deployment, pool.base_job_template)
            except RunRefused as err:
                self.get_flow_run_logger(flow_run).error(f"refused by the stack's worker: {err}")
                raise
            configuration = await self.job_configuration.resolve_for_flow_run(
                copy.deepcopy(flow_run), client=self.client, work_pool=pool,
                worker_name=self.name, worker_id=self.backend_id,
                deployment=copy.deepcopy(deployment))
            return await super().run(flow_run, configuration, task_status)


async def _serve(pool: str, name: str | None, limit: int | None) -> None:
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS

    async with GuardedProcessWorker(work_pool_name=pool, name=name, limit=limit,
                                    create_pool_if_not_found=False,
                                    heartbeat_interval_seconds=int(
                                        PREFECT_WORKER_HEARTBEAT_SECONDS.value())) as worker:
        await worker.start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args(argv)
    asyncio.run(_serve(args.pool, args.name, args.limit))


if __name__ == "__main__":
    main()
