"""Engine replica loss in the rollout service, in one process (real tiny policy, HF engines,
in-process env host). A replica "dies" the way a lost worker looks from the caller: its calls
raise the OSError Dask raises for an unreachable actor (the real worker kill is in
tests/integration/test_engine_worker_loss.py)."""

import threading
import time

import pytest
import torch
from distributed.comm.core import CommClosedError

from rollart.config import load_config
from rollart.engines.hf import HFEngine
from rollart.envs import make_env
from rollart.handles import CallTimeoutError
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model
from rollart.models.tokenizer import build_tokenizer
from rollart.rewards.client import LocalRewardClient
from rollart.rollout.env_host import EnvHost
from rollart.rollout.env_manager import constrained_params
from rollart.rollout.failover import EngineHealth, NoReplicaLeft, is_replica_loss
from rollart.rollout.service import RolloutService
from rollart.types import SamplingParams

TASKS = "tasks=[{name: lake, env_id: FrozenLake-v1, max_turns: 3, constrained: true}]"


class Severable:
    """An engine handle whose worker can be cut off: after `cut()` every call fails like a call
    to an actor whose worker died (or, with `error`, with the engine's own exception)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.model = engine, engine.model
        self.error: BaseException | None = None
        self.calls = 0

    def cut(self, error: BaseException | None = None) -> None:
        self.error = error or OSError("Unable to contact Actor's worker")

    def generate(self, requests):
        if self.error is not None:
            raise self.error
        self.calls += 1
        return self.engine.generate(requests)


@pytest.fixture(params=["threads", "asyncio"])
def runner(request):
    """Every service test runs with episodes as threads and as asyncio tasks."""
    return request.param


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    cfg = load_config(None, [TASKS])
    tok = build_tokenizer(make_env(cfg.tasks[0]).corpus_texts(episodes=5), 320)
    return build_tiny_model(cfg.model.tiny, tok, seed=0), tok


def _service(policy, *overrides: str) -> tuple[RolloutService, list[Severable]]:
    model, tok = policy
    cfg = load_config(None, [TASKS, "rollout.num_groups=2", "rollout.group_size=4",
                             "engine.replicas=2",
                             "iterations=4", *overrides])
    chat = ChatFormat(tok)
    params = constrained_params(SamplingParams(max_new_tokens=4, stop=["</answer>"]), chat,
                                cfg.tasks)
    engines = [Severable(HFEngine(model, tok, seed=r)) for r in range(2)]
    return RolloutService(cfg, chat, engines, [EnvHost(cfg.tasks)], LocalRewardClient(),
                          params), engines


def _advance(svc: RolloutService, engines: list[Severable], update: int) -> None:
    for e in engines:
        e.engine.weight_version = update + 1
    svc.set_version(update + 1)


def test_what_counts_as_a_lost_replica():
    assert is_replica_loss(CallTimeoutError("EngineService.generate did not answer"))
    assert is_replica_loss(OSError("Unable to contact Actor's worker"))
    assert is_replica_loss(CommClosedError("in <TCP ...>: Stream is closed"))
    assert is_replica_loss(RuntimeError("Worker holding Actor was lost.  Status: lost"))
    # the engine's own errors cost the episode, not the replica
    assert not is_replica_loss(ValueError("prompt longer than the context"))
    assert not is_replica_loss(RuntimeError("CUDA error: device-side assert triggered"))


def test_waiting_for_a_replica_is_bounded_and_ends_when_one_comes_back():
    health = EngineHealth(2, wait_timeout_s=0.3)
    assert health.mark_lost(0, "x") and not health.mark_lost(0, "again")  # first one acts
    assert health.wait_any() == [1]
    health.mark_lost(1, "y")
    t0 = time.monotonic()
    with pytest.raises(NoReplicaLeft, match="engine_wait_timeout_s"):
        health.wait_any()
    assert 0.25 < time.monotonic() - t0 < 2.0
    health.wait_timeout_s = 10.0
    threading.Timer(0.2, health.mark_back, (1,)).start()
    assert health.wait_any() == [1]
    assert (health.lost_total, health.back_total) == (2, 1)


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_lost_replica_turns_are_reissued_and_every_sample_is_kept_once(policy, runner, batching):
    svc, engines = _service(policy, f"rollout.runner={runner}", f"rollout.batching={batching}")
    svc.start()
    consumed = []
    try:
        trajs, _ = svc.take_batch(0, timeout=60)
        consumed += [t.sample_id for t in trajs]
        # The affinity router (continuous) may keep every turn on one replica: cut a busy one.
        lost = max(range(2), key=lambda i: engines[i].calls)
        engines[lost].cut()  # its worker dies between batches; the next turns sent to it fail
        _advance(svc, engines, 0)
        for update in (1, 2):
            trajs, info = svc.take_batch(update, timeout=60)
            assert len(trajs) == 8 and all(t.error is None for t in trajs)
            # every token of these episodes came from the surviving replica, version update
            assert {v for t in trajs for v in t.token_versions if v >= 0} == {update}
            assert not info["dropped"]  # nothing failed, nothing was lost
            consumed += [t.sample_id for t in trajs]
            if update == 1:
                _advance(svc, engines, update)
        assert info["metrics"]["rollout/engines_lost"] == 1.0
        assert info["metrics"]["rollout/engines_serving"] == 1.0
        # A replacement (current weights) joins the rotation and serves the next batch.
        fresh = Severable(HFEngine(engines[1].model, engines[1].engine.tokenizer, seed=7))
        svc.replace_engine(lost, fresh)
        engines[lost] = fresh
        _advance(svc, engines, 2)
        trajs, info = svc.take_batch(3, timeout=60)
        consumed += [t.sample_id for t in trajs]
    finally:
        stats = svc.stop()
    c = stats["counters"]
    assert c["engines_lost"] == 1 and c["engines_replaced"] == 1
    assert c["turns_reissued"] >= 1  # the turns in flight on it went to the other one
    assert "failed" not in c and "engine_errors" not in c  # a lost replica fails no episode
    assert stats["engines_alive"] == [True, True]
    if batching == "lockstep":  # new episodes spread over the replicas, the fresh one too
        assert fresh.calls > 0
    else:  # the router failed the lost replica's episodes over (`router/failover`)
        assert info["metrics"]["rollout/router/failover"] >= 1
    assert len(consumed) == len(set(consumed)) == 32


def test_with_no_replica_left_the_run_waits_then_fails_naming_the_cause(policy, runner):
    svc, engines = _service(policy, f"rollout.runner={runner}", "rollout.engine_wait_timeout_s=1.5")
    for e in engines:
        e.cut()
    svc.start()
    try:
        with pytest.raises(RuntimeError, match="none came back within 1.5 s"):
            svc.take_batch(0, timeout=60)
    finally:
        svc.stop()


def test_a_replacement_within_the_wait_lets_the_run_go_on(policy, runner):
    svc, engines = _service(policy, f"rollout.runner={runner}", "rollout.engine_wait_timeout_s=60")
    for e in engines:
        e.cut()
    fresh = Severable(HFEngine(engines[0].model, engines[0].engine.tokenizer, seed=3))
    svc.start()
    threading.Timer(1.0, svc.replace_engine, (1, fresh)).start()
    try:
        trajs, _ = svc.take_batch(0, timeout=60)
    finally:
        stats = svc.stop()
    assert len(trajs) == 8 and fresh.calls > 0
    assert stats["counters"]["engines_lost"] == 2 and "failed" not in stats["counters"]


def test_an_engine_error_fails_episodes_as_engine_errors_not_env_errors(policy, runner):
    svc, engines = _service(policy, f"rollout.runner={runner}",
                            "rollout.max_consecutive_failures=6")
    for e in engines:
        e.cut(ValueError("bad request"))
    svc.start()
    try:
        with pytest.raises(RuntimeError, match="6 episodes failed in a row"):
            svc.take_batch(0, timeout=60)
    finally:
        stats = svc.stop()
    c = stats["counters"]
    assert c["engine_errors"] == c["failed"] >= 6
    assert "engines_lost" not in c and stats["engines_alive"] == [True, True]
