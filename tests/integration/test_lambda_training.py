"""An embedded training run whose rewards all go through the local Lambda endpoint.

`run_local` is the Prefect flow's iteration in one process; `score` builds its reward client from
`cfg.reward`, so `reward.backend=lambda` + `reward.endpoint_url` sends every episode through
boto3 -> local endpoint -> awslambdaric -> `env_outcome`.
"""

from __future__ import annotations

import pytest

from infra.lambda_endpoint import LocalLambda
from infra.lambda_functions import FunctionSpec
from rollart.config import load_config
from rollart.rewards.client import reward_event
from rollart.rewards.handlers import env_outcome
from rollart.runner.local_loop import run_local
from rollart.storage.store import RunStore

pytestmark = pytest.mark.integration


def test_two_iterations_with_lambda_rewards(tmp_path, monkeypatch):
    with LocalLambda([FunctionSpec("rollart-env-outcome", "env_outcome", concurrency=4)],
                     idle_timeout_s=30) as lam:
        for k, v in lam.credentials.env().items():  # the run's reward client signs with these
            monkeypatch.setenv(k, v)
        cfg = load_config("configs/default.yaml", [
            "iterations=2", "rollout.num_groups=2", "rollout.group_size=4",
            "tasks.0.max_turns=3", "eval.episodes=0", f"storage.root={tmp_path}",
            "reward.backend=lambda", "reward.function_name=rollart-env-outcome",
            f"reward.endpoint_url={lam.url}", "reward.max_concurrency=4",
            "reward.on_error=fail",
        ])
        out = run_local(cfg, "lambda-run")
        metrics = lam.metrics()["functions"]["rollart-env-outcome"]

    store = RunStore(str(tmp_path), "lambda-run")
    scored = [t for it in range(2) for t in store.read_shards(it)]
    assert len(out["curve"]) == 2 and len(scored) > 0
    # Every scored episode was one invocation of the endpoint, and nothing else was.
    assert metrics["invocations"] == len(scored)
    assert metrics["errors"] == 0 and metrics["throttles"] == 0
    assert 1 <= metrics["peak_workers"] <= 4
    # The rewards that came back are the handler's, episode by episode.
    for t in scored:
        assert t.reward == pytest.approx(env_outcome(reward_event(t))["reward"])
        assert t.timings["reward_s"] > 0
