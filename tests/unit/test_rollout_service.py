"""The rollout service in one process (real tiny policy, HF engine, in-process env host): bounded
staleness across versions, redundancy, injected failures, and the ledger's view of every episode."""

from collections import Counter

import pytest
import torch

from rollart.config import load_config
from rollart.engines.hf import HFEngine
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model
from rollart.models.tokenizer import build_tokenizer
from rollart.rewards.client import LocalRewardClient
from rollart.rollout.env_host import EnvHost
from rollart.rollout.env_manager import constrained_params
from rollart.rollout.ids import parse_group_id
from rollart.rollout.service import RolloutService
from rollart.types import SamplingParams

TASKS = ("tasks=[{name: lake, env_id: FrozenLake-v1, max_turns: 3, constrained: true}, "
         "{name: slow, env_id: FrozenLake-v1, max_turns: 3, constrained: true, "
         "latency: {median_s: 0.002, tail_prob: 0.2, tail_s: 0.05}, "
         "faults: {step_error_rate: 0.1}}]")


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


def _service(policy, *overrides: str, host_chat: ChatFormat | None = None) -> RolloutService:
    model, tok = policy
    cfg = load_config(None, [TASKS, "rollout.num_groups=4", "rollout.group_size=3",
                             "iterations=4", *overrides])
    chat = ChatFormat(tok)
    params = constrained_params(SamplingParams(max_new_tokens=4, stop=["</answer>"]), chat,
                                cfg.tasks)
    engines = [HFEngine(model, tok, seed=r) for r in range(2)]
    return RolloutService(cfg, chat, engines, [EnvHost(cfg.tasks, host_chat)],
                          LocalRewardClient(), params)


def _take_and_advance(svc: RolloutService, update: int, timeout: float) -> tuple[list, dict]:
    """Batch `update`; then the weights "change": the engines serve update + 1."""
    trajs, info = svc.take_batch(update, timeout=timeout)
    for e in svc.batchers:
        e.engine.weight_version = update + 1
    svc.set_version(update + 1)
    return trajs, info


def test_an_env_host_that_tokenizes_changes_where_the_work_runs_not_one_id(policy, runner):
    """EnvHost(tasks, chat) sends the prompt ids of what its envs say (production hosts do:
    EnvHostService), so the rollout service tokenizes nothing itself; the trajectories are
    the same, id for id (lockstep, alpha 0: deterministic)."""
    runs, calls = [], []
    for host_chat in (None, ChatFormat(policy[1])):
        svc = _service(policy, "tasks=[{name: lake, env_id: FrozenLake-v1, max_turns: 3}]",
                       f"rollout.runner={runner}", host_chat=host_chat)
        made = []
        user = svc.chat.user
        svc.chat.user = lambda text, made=made, user=user: made.append(text) or user(text)
        svc.start()
        try:
            trajs, _ = svc.take_batch(0, timeout=60)
        finally:
            svc.stop()
        runs.append({t.sample_id: (t.token_ids, t.loss_mask) for t in trajs})
        calls.append(len(made))
    assert runs[0] == runs[1] and len(runs[0]) == 4 * 3
    assert calls[0] > 0 and calls[1] == 0


@pytest.mark.parametrize("overrides", [
    ("rollout.max_staleness=0", "rollout.batching=lockstep"),
    ("rollout.max_staleness=1", "rollout.batching=continuous", "rollout.redundancy=1"),
])
def test_batches_respect_the_bound_and_every_episode_is_accounted_once(policy, runner, overrides):
    svc = _service(policy, f"rollout.runner={runner}", *overrides)
    alpha = svc.cfg.rollout.max_staleness
    svc.start()
    consumed, dropped, failed_per_batch = [], [], []
    try:
        for update in range(4):
            trajs, info = _take_and_advance(svc, update, timeout=60)
            assert len(trajs) == 4 * 3 and all(t.reward is not None for t in trajs)
            for t in trajs:
                versions = {x for x in t.token_versions if x >= 0}
                assert versions and update - min(versions) <= alpha, (update, versions)
            tasks = Counter(t.task for t in trajs)
            assert tasks == {"lake": 6, "slow": 6}  # each task its share of every batch
            consumed += [t.sample_id for t in trajs]
            dropped += [d[0] for d in info["dropped"]]
            m = info["metrics"]
            failed_per_batch.append(m["rollout/failed"])
    finally:
        stats = svc.stop()
    c = stats["counters"]
    assert len(set(consumed)) == len(consumed) == 48
    assert not set(consumed) & set(dropped) and len(set(dropped)) == len(dropped)
    assert m["rollout/failed_total"] == c.get("failed", 0) >= 1  # ~10 % of the slow task's steps
    assert sum(failed_per_batch) == m["rollout/failed_total"]  # per batch adds up to the total
    failures = c.get("failed", 0) + c.get("timeouts", 0)
    if svc.cfg.rollout.redundancy:  # a spare still running makes a re-issue unnecessary
        assert c["cancelled_redundant"] >= 1
        assert c.get("retried", 0) <= failures
    else:  # every failure is re-issued, except the one that spends a group's retry budget
        assert c["retried"] + c.get("groups_dropped_failures", 0) == failures, c
        assert c.get("dropped_stale_groups", 0) == 0 and c.get("cancelled_stale", 0) == 0


def test_a_batch_asked_for_again_is_the_same_batch(policy, runner):
    """A collect stage re-run by Dask (its worker died after taking the batch) gets the batch it
    took, not a wait for ever on an update the scheduler has moved past."""
    svc = _service(policy, f"rollout.runner={runner}", "rollout.max_staleness=0",
                   "rollout.batching=lockstep")
    svc.start()
    try:
        trajs, info = svc.take_batch(0, timeout=60)
        started = svc.sched.counters["groups_started"]
        again, info2 = svc.take_batch(0, timeout=5)
        assert [t.sample_id for t in again] == [t.sample_id for t in trajs] and info2 is info
        assert svc.sched.counters["groups_started"] == started  # nothing new issued
        assert svc.sched.next_update == 1
    finally:
        svc.stop()


def test_failed_is_per_batch_and_failed_total_cumulative(policy, runner):
    svc = _service(policy, f"rollout.runner={runner}")  # not started: the counters are set by hand
    svc.sched.counters["failed"] += 2
    first = svc._metrics([])
    svc.sched.counters["failed"] += 1
    second = svc._metrics([])
    third = svc._metrics([])
    assert [(x["rollout/failed"], x["rollout/failed_total"]) for x in (first, second, third)] \
        == [(2.0, 2.0), (1.0, 3.0), (0.0, 3.0)]


def test_an_env_that_always_fails_ends_the_run_with_its_error(policy, runner):
    broken = ("tasks=[{name: lake, env_id: FrozenLake-v1, max_turns: 3, constrained: true, "
              "faults: {step_error_rate: 0.99}}]")
    svc = _service(policy, f"rollout.runner={runner}", broken, "rollout.max_consecutive_failures=8")
    svc.start()
    try:
        with pytest.raises(RuntimeError, match="8 episodes failed in a row") as err:
            svc.take_batch(0, timeout=60)
    finally:
        stats = svc.stop()
    assert "InjectedFault: injected env step error" in str(err.value)  # the cause, not just a count
    assert stats["counters"]["failed"] >= 8


def test_groups_that_scored_alike_are_replaced_and_accounted(policy, runner):
    """rollout.resample_uniform: a group whose episodes all scored alike (the untrained policy
    mostly fails FrozenLake) is set aside and its slot tried again with a new id and seed, up
    to twice; every batch still holds num_groups groups, a kept group has signal unless it is
    its slot's last try, and each set-aside episode is a "uniform" drop, never trained."""
    svc = _service(policy, "tasks=[{name: lake, env_id: FrozenLake-v1, max_turns: 3}]",
                   f"rollout.runner={runner}", "rollout.resample_uniform=2")
    svc.start()
    consumed, uniform = [], []
    try:
        for update in range(2):
            trajs, info = _take_and_advance(svc, update, timeout=120)
            by_group: dict[str, list[float]] = {}
            for t in trajs:
                by_group.setdefault(t.group_id, []).append(t.reward)
            assert len(by_group) == 4 and all(len(r) == 3 for r in by_group.values())
            for gid, rewards in by_group.items():
                slot_try = parse_group_id(gid)[2] // 4  # 0: planned, k: k-th replacement
                assert len(set(rewards)) > 1 or slot_try == 2, (gid, rewards)
            consumed += [t.sample_id for t in trajs]
            uniform += [d[0] for d in info["dropped"] if d[2] == "uniform"]
            m = info["metrics"]
    finally:
        stats = svc.stop()
    c = stats["counters"]
    assert c["groups_resampled"] >= 1 and m["rollout/groups_resampled"] == c["groups_resampled"]
    assert len(uniform) == 3 * c["groups_resampled"] and not set(uniform) & set(consumed)
    assert m["rollout/resampled_model_tokens"] > 0
    assert m["rollout/resampled_env_steps"] >= len(uniform)  # a turn at least each
