"""Sharded rollout on the asyncio runner, at a small scale, with emulated engines and env hosts
(rollart/rollout/emulated.py): the real services, schedulers, routers and coordinator; every
episode is consumed at most once, the staleness bound and each task's share hold across shards,
the shards partition the plan's groups, and admission stays under the unsharded cap."""

import time

import pytest

from rollart.config import load_config
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.models.tokenizer import build_tokenizer
from rollart.rewards.client import LocalRewardClient
from rollart.rollout.emulated import EmulatedEngine, EmulatedEnvHost
from rollart.rollout.plan import plan_iteration
from rollart.rollout.service import RolloutService
from rollart.rollout.shards import ShardedRollout, shard_quota, shard_slots
from rollart.types import SamplingParams

TASKS = ("tasks=[{name: a, env_id: FrozenLake-v1, share: 2}, "
         "{name: b, env_id: FrozenLake-v1, share: 1}]")


@pytest.fixture(scope="module")
def chat():
    cfg = load_config(None, [TASKS])
    return ChatFormat(build_tokenizer(make_env(cfg.tasks[0]).corpus_texts(episodes=3), 320))


def _cfg(*overrides: str):
    return load_config(None, [TASKS, "rollout.num_groups=6", "rollout.group_size=3",
                              "rollout.runner=asyncio", "rollout.batching=continuous",
                              "rollout.batch_wait_s=0", "engine.replicas=3", "iterations=8",
                              *overrides])


def _shards(chat, cfg, n: int, host_ids: bool = False
            ) -> tuple[list[RolloutService], list[EmulatedEngine]]:
    engines = [EmulatedEngine(0.002, 0.0005, chat.encode("<answer>right</answer>"),
                              "<answer>right</answer>") for _ in range(3)]
    params = {t.name: SamplingParams(max_new_tokens=8) for t in cfg.tasks}
    return [RolloutService(cfg, chat, engines,
                           [EmulatedEnvHost(0.003, 2, 4, chat=chat if host_ids else None)],
                           LocalRewardClient(), params, shard=(k, n)) for k in range(n)], engines


def test_prompt_ids_sent_by_the_host_are_the_ids_the_service_makes(chat):
    """An env host that tokenizes its observations changes where the work runs, not one id."""
    runs = []
    for host_ids in (False, True):
        (svc,), _ = _shards(chat, _cfg(), 1, host_ids)
        svc.start()
        try:
            trajs, _ = svc.take_batch(0, timeout=15)
        finally:
            svc.stop()
        runs.append({t.sample_id: (t.token_ids, t.loss_mask) for t in trajs})
    assert runs[0] == runs[1] and len(runs[0]) == 18
    per_turn = len(chat.encode("<answer>right</answer>"))
    assert all(m.count(1) >= 2 * per_turn for _, m in runs[0].values())  # 2+ turns each


def test_slots_partition_every_batch():
    cfg = _cfg()
    for n in (1, 2, 3, 4):
        parts = [shard_slots(cfg, k, n) for k in range(n)]
        for task, q in (("a", 4), ("b", 2)):
            mine = sorted(s for p in parts for s in p[task])
            assert mine == list(range(q))  # each slot on exactly one shard
        quotas = [dict(shard_quota(cfg, k, n)) for k in range(n)]
        assert sum(q["a"] for q in quotas) == 4 and sum(q["b"] for q in quotas) == 2
        assert max(sum(q.values()) for q in quotas) - min(sum(q.values()) for q in quotas) <= 1
    with pytest.raises(ValueError, match="num_groups is 6"):
        shard_slots(cfg, 0, 7)


@pytest.mark.parametrize("alpha", [0, 2])
def test_sharded_batches_keep_the_bound_shares_and_each_episode_once(chat, alpha):
    cfg = _cfg(f"rollout.max_staleness={alpha}")
    shards, engines = _shards(chat, cfg, 2)
    coord = ShardedRollout(shards)
    consumed, dropped, peak_groups = [], [], 0
    coord.start()
    try:
        for update in range(6):
            t0 = time.monotonic()
            while (out := coord.try_take(update)) is None:
                assert time.monotonic() - t0 < 15, "no batch"
                peak_groups = max(peak_groups, sum(len(s.sched.groups) for s in shards))
                time.sleep(0.002)
            trajs, info = out
            assert coord.try_take(update) is out  # asked again: the same batch
            assert len(trajs) == 6 * 3 and all(t.reward is not None for t in trajs)
            assert sorted({t.task for t in trajs}) == ["a", "b"]
            assert sum(t.task == "a" for t in trajs) == 4 * 3  # each task its share
            for t in trajs:  # the bound, whichever shard ran it
                versions = {v for v in t.token_versions if v >= 0}
                assert versions and update - min(versions) <= alpha, (update, versions)
            if alpha == 0:  # synchronous: batch u is the plan's iteration u, shards or not
                assert {t.group_id for t in trajs} == \
                    {s.group_id for s in plan_iteration(cfg, update)}
            consumed += [t.sample_id for t in trajs]
            dropped += [d[0] for d in info["dropped"]]
            for e in engines:
                e.weight_version = update + 1
            coord.set_version(update + 1)
    finally:
        stats = coord.stop()
    assert len(consumed) == len(set(consumed)) == 6 * 18  # each episode consumed once
    assert not set(consumed) & set(dropped) and len(dropped) == len(set(dropped))
    # Admission across shards: never more than (alpha + 1) batches of groups at once.
    assert 0 < peak_groups <= (alpha + 1) * 6
    # Each shard ran only the groups of its own slots.
    for k, s in enumerate(shards):
        mine = {(t, g) for t, slots in shard_slots(cfg, k, 2).items() for g in slots}
        ran = {(gid.split("/")[0], int(gid.rsplit("/g", 1)[1]))
               for gid in s.sched.episode_group.values()}
        assert ran <= mine
    assert stats["counters"]["episodes_finished"] >= 6 * 18
    assert "failed" not in stats["counters"]


def test_a_checkpoint_resumes_only_with_the_same_number_of_shards(chat):
    """A sharded run's rollout state holds one part per shard; a resume with another
    `rollout.shards` fails before anything starts, saying which value the checkpoint needs."""
    import json

    cfg = _cfg("rollout.max_staleness=1")
    two, _ = _shards(chat, cfg, 2)
    sharded = json.dumps({"format": "sharded", "shards": [None, None]}).encode()
    one, _ = _shards(chat, cfg, 1)
    with pytest.raises(ValueError, match="resume with rollout.shards=2"):
        one[0].restore_state(sharded, [])
    plain = json.dumps({"format": 1, "groups": []}).encode()
    with pytest.raises(ValueError, match="resume with rollout.shards=1"):
        ShardedRollout(two).restore_state(plain, [])
    with pytest.raises(ValueError, match="resume with rollout.shards=2"):
        ShardedRollout(two + one).restore_state(sharded, [])


def test_shards_are_a_config_choice_checked_at_load():
    with pytest.raises(Exception, match="rollout.shards=7 but rollout.num_groups=6"):
        _cfg("rollout.shards=7")
    assert _cfg("rollout.shards=2").rollout.shards == 2


def test_stop_reaches_every_shard_even_when_one_is_lost():
    class Lost:
        def stop(self):
            raise OSError("its worker is gone")

    class Live:
        stopped = False

        def stop(self):
            self.stopped = True
            return {"counters": {}}

    live = [Live(), Live()]
    with pytest.raises(OSError, match="gone"):
        ShardedRollout([live[0], Lost(), live[1]]).stop()
    assert all(x.stopped for x in live)
