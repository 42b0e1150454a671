"""The asyncio runner's memory and pause discipline at small scale (emulated engines and env
hosts, the real service): finished episodes are freed by reference counting alone, with the
cycle collector off while the loop runs; placement counts stay in step with the live episodes;
a batch's worth of groups starts in slices (the same groups as one fill)."""

import gc
import time
import weakref
from collections import Counter

import pytest

from rollart.config import load_config
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.models.tokenizer import build_tokenizer
from rollart.rewards.client import LocalRewardClient
from rollart.rollout import service as service_mod
from rollart.rollout.batcher import LiveEpisode
from rollart.rollout.emulated import EmulatedEngine, EmulatedEnvHost
from rollart.rollout.scheduler import RolloutScheduler, SchedulerConfig
from rollart.rollout.service import RolloutService
from rollart.types import SamplingParams

ANSWER = "<answer>right</answer>"


@pytest.fixture(scope="module")
def chat():
    cfg = load_config(None, ["tasks=[{name: a, env_id: FrozenLake-v1}]"])
    return ChatFormat(build_tokenizer(make_env(cfg.tasks[0]).corpus_texts(episodes=3), 320))


def _service(chat, event_loop: str = "select", engine_cls: type = EmulatedEngine,
             extra: tuple[str, ...] = ()) -> RolloutService:
    cfg = load_config(None, [
        "tasks=[{name: a, env_id: FrozenLake-v1}]", "rollout.num_groups=16",
        "rollout.group_size=2", "rollout.max_staleness=1", "rollout.runner=asyncio",
        "rollout.batching=continuous", "rollout.batch_wait_s=0", "engine.replicas=2",
        "iterations=10", f"rollout.event_loop={event_loop}", *extra])
    engines = [engine_cls(0.002, 0.0, chat.encode(ANSWER), ANSWER) for _ in range(2)]
    return RolloutService(cfg, chat, engines, [EmulatedEnvHost(0.002, 2, 3, chat=chat)],
                          LocalRewardClient(), {"a": SamplingParams(max_new_tokens=8)})


def test_finished_episodes_are_freed_without_the_cycle_collector(chat, monkeypatch):
    made: dict[str, weakref.ref] = {}

    class Tracked(LiveEpisode):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made[self.id] = weakref.ref(self)

    monkeypatch.setattr(service_mod, "LiveEpisode", Tracked)
    was_enabled = gc.isenabled()
    svc = _service(chat)
    svc.start()
    try:
        assert not gc.isenabled()  # rollout.gc_every_s: collections only on the sweeper's clock
        consumed: list[str] = []
        for u in range(2):
            trajs, _ = svc.take_batch(u, timeout=30)
            consumed += [t.sample_id for t in trajs]
            svc.set_version(u + 1)
        time.sleep(0.2)  # let the loop finish the callbacks of the last episodes
        with svc.lock:
            assert svc.on_engine == Counter(x.engine for x in svc.live.values())
            assert svc.on_host == Counter(x.host for x in svc.live.values())
            assert svc.done_stats.keys() == svc.done.keys()  # a batch's metric inputs go with it
            alive = [eid for eid in consumed if made[eid]() is not None]
        # Nothing but a reference cycle can keep a consumed episode's LiveEpisode alive: the
        # service, its batchers and the loop let go of it when its episode ends.
        assert len(consumed) == 64 and alive == []
    finally:
        svc.stop()
    assert gc.isenabled() == was_enabled


def test_groups_started_in_slices_are_the_groups_of_one_fill():
    cfg = SchedulerConfig(group_size=3, batch_groups=5, max_staleness=2, redundancy=1,
                          task_shares=(("a", 2.0), ("b", 1.0)))
    whole, sliced = RolloutScheduler(cfg), RolloutScheduler(cfg)
    one = whole.fill()
    parts: list = []
    while True:
        got = sliced.fill(max_groups=2)
        parts += got
        if len(got) < 2 * (cfg.group_size + cfg.redundancy):
            break
    assert len(one) == 15 * 4  # (0 + 2 + 1) batches x 5 groups x 4 launched
    assert sorted(parts, key=lambda s: s.episode_id) == sorted(one, key=lambda s: s.episode_id)
    assert sliced.fill(max_groups=2) == [] and sliced._per_task == whole._per_task


def test_consumed_and_dropped_groups_leave_no_episode_index_behind():
    """`episode_group` holds the episodes of the groups the scheduler still has, so a long
    run's scheduler does not grow with every episode it ever started."""
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, max_staleness=0,
                                         redundancy=1))
    for u in range(20):
        starts = s.fill()
        for st in starts[:2]:
            s.on_finished(st.episode_id)  # the third (redundant) one is cancelled
        assert s.take_batch(u) is not None
        s.on_version(u + 1)
    starts = s.fill()
    s.on_version(22)  # past the bound: the running group is dropped as stale
    assert s.groups == {} and s.episode_group == {}
    assert s.counters["groups_consumed"] == 20 and s.counters["dropped_stale_groups"] == 1


@pytest.mark.parametrize("event_loop", ["uvloop", "select"])
def test_new_episodes_start_paced_not_a_batch_at_once(chat, event_loop):
    """The first fill admits two batches (32 groups, 64 episodes). At `rollout.start_rate`
    1,000/s the first slice holds START_BURST_S (4 ms) of it, 2 groups; each later one the
    whole groups the rate allows since the previous slice (a part of a group carries over):
    the 64 episodes start spread over time, not in consecutive loop iterations."""
    svc = _service(chat, event_loop, extra=("rollout.start_rate=1000",))
    slices: list[tuple[float, int]] = []
    launch = svc._launch

    def record(starts):
        if starts:
            slices.append((time.monotonic(), len(starts)))
        launch(starts)

    svc._launch = record
    svc.start()
    try:
        deadline = time.monotonic() + 10
        while sum(n for _, n in slices) < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        svc.stop()
    assert sum(n for _, n in slices) >= 64
    assert slices[0][1] == 2 * 2  # 2 groups of 2 episodes
    for (t0, _), (t1, n) in zip(slices, slices[1:], strict=False):
        # what the rate allows since the previous slice plus less than a group carried over
        # (2 episodes: 2 ms at 1,000/s), and 0.5 ms of slack: the recorded times come a little
        # after the slices' own clock readings
        assert n <= int((t1 - t0 + 0.0025) * 1000), slices
        if event_loop == "select":  # microsecond timers: START_GAP_S apart. uvloop's timers
            assert t1 - t0 >= 0.001 * 0.9  # count whole ms of a clock read once per iteration
    n_until_64 = next(i for i in range(len(slices)) if sum(n for _, n in slices[: i + 1]) >= 64)
    assert slices[n_until_64][0] - slices[0][0] >= (64 - 4) / 1000 * 0.9  # the rate held


class OneCallAtATime(EmulatedEngine):
    concurrent_calls = 1  # an engine that batches nothing itself (the HF engine, say)


class LostAtOnce(EmulatedEngine):
    """Replica 0's worker is gone from the start: every call fails as a lost actor's does."""

    lost = False

    async def generate(self, requests):
        if self.lost:
            raise OSError("Unable to contact Actor's worker")
        return await super().generate(requests)


def _run_two_batches(svc: RolloutService) -> list:
    """Start `svc`, take two batches (64 episodes), stop; each sample id once. The engines."""
    ids: list[str] = []
    svc.start()
    try:
        for u in range(2):
            trajs, _ = svc.take_batch(u, timeout=30)
            ids += [t.sample_id for t in trajs]
            svc.set_version(u + 1)
    finally:
        svc.stop()
    assert len(ids) == len(set(ids)) == 64
    return [b.engine for b in svc.batchers]


def test_a_released_batch_is_freed_a_slice_at_a_time(chat):
    """`release` frees RELEASE_SLICE objects per slice, slices >= RELEASE_GAP_S apart (on the
    select loop's exact timers): a batch of 64 takes at least 7 gaps, not one loop iteration."""
    class Obj:
        pass

    svc = _service(chat, "select")
    svc.start()
    try:
        objs = [Obj() for _ in range(64)]
        refs = [weakref.ref(o) for o in objs]
        alive: list[tuple[float, int]] = []
        t0 = time.monotonic()
        svc.runner.release(objs)
        del objs  # the runner holds the only list
        while time.monotonic() < t0 + 5:
            n = sum(r() is not None for r in refs)
            alive.append((time.monotonic(), n))
            if n == 0:
                break
            time.sleep(0.0002)
    finally:
        svc.stop()
    assert alive[-1][1] == 0
    slices = 64 // svc.runner.RELEASE_SLICE
    assert alive[-1][0] - t0 >= (slices - 1) * svc.runner.RELEASE_GAP_S * 0.9, alive
    assert all(64 - n <= svc.runner.RELEASE_SLICE * (1 + (t - t0) / svc.runner.RELEASE_GAP_S)
               for t, n in alive), alive  # never more than the slices due by then


def test_a_turn_goes_straight_to_an_engine_that_takes_concurrent_calls(chat):
    """With call slots free, nothing queued and no batch wait, a turn is its own call, awaited
    in the episode's task (no batcher round trip): one request per call, every call direct."""
    svc = _service(chat)
    assert all(b.direct for b in svc.batchers)
    engines = _run_two_batches(svc)
    assert sum(e.calls for e in engines) > 0
    for b, e in zip(svc.batchers, engines, strict=True):
        assert b.direct_calls == b.calls == e.calls == e.requests


def test_an_engine_of_one_call_at_a_time_still_gets_batches(chat):
    """Such an engine's turns wait in the batcher's queue while a call runs and go together:
    some calls carry several requests, none go direct."""
    svc = _service(chat, engine_cls=OneCallAtATime)
    assert not any(b.direct for b in svc.batchers)
    engines = _run_two_batches(svc)
    assert all(b.direct_calls == 0 for b in svc.batchers)
    assert sum(e.requests for e in engines) > sum(e.calls for e in engines)


def test_a_direct_call_to_a_lost_replica_is_reissued_on_another(chat):
    svc = _service(chat, engine_cls=LostAtOnce)
    svc.batchers[0].engine.lost = True
    _run_two_batches(svc)
    assert svc.health.lost_indices() == [0]
    assert svc.totals.counters["turns_reissued"] > 0
    assert svc.batchers[1].engine.calls > 0 and svc.batchers[0].engine.calls == 0


def test_select_loop_refuses_a_wakeup_pipe_out_of_selects_range():
    """select(2) watches descriptors below FD_SETSIZE only: a process with more files open
    gets a clear error naming the fix, not a loop that dies on its first wait."""
    import os
    import resource

    from rollart.rollout.aio_runner import SELECT_FD_LIMIT, new_loop

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SELECT_FD_LIMIT + 64:
        pytest.skip(f"the hard limit on open files ({hard}) is too low to test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, SELECT_FD_LIMIT + 64), hard))
    held = []
    try:
        while not held or held[-1] < SELECT_FD_LIMIT:
            held.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(RuntimeError, match="rollout.event_loop=uvloop"):
            new_loop("select")
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    new_loop("select").close()  # with the files closed, it works
