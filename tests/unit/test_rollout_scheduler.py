"""The pure rollout scheduler: staleness bound, redundancy, completion, re-issue after failure."""

from rollart.rollout.scheduler import Cancel, RolloutScheduler, SchedulerConfig, Start


def _finish_group(s: RolloutScheduler, starts: list[Start], gid: str, n: int) -> list[Cancel]:
    out: list[Cancel] = []
    for st in [x for x in starts if x.group_id == gid][:n]:
        out += s.on_finished(st.episode_id)
    return out


def test_synchronous_baseline_alpha0_admits_one_batch():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=2, max_staleness=0))
    starts = s.fill()
    assert len(starts) == 4 and {x.version for x in starts} == {0}
    assert s.fill() == []  # capacity: (0 + 1) * 2 groups
    _finish_group(s, starts, "g0", 2)
    assert s.take_batch(0) is None  # one of two groups complete
    _finish_group(s, starts, "g1", 2)
    batch = s.take_batch(0)
    assert batch == {"g0": ["g0/m0", "g0/m1"], "g1": ["g1/m0", "g1/m1"]}
    # Synchronous: nothing starts between taking batch 0 and the engines serving version 1
    # (it would be stale for update 1 before it could be used).
    assert s.fill() == []
    s.on_version(1)
    assert {x.version for x in s.fill()} == {1}


def test_staleness_bound_waits_for_expiring_groups_and_drops_past_it():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, max_staleness=1))
    first = s.fill()  # g0, g1 at version 0 (room for updates 0 and 1)
    assert sorted({x.group_id for x in first}) == ["g0", "g1"]
    _finish_group(s, first, "g0", 2)
    assert list(s.take_batch(0)) == ["g0"]
    assert s.on_version(1) == []  # g1 (v0) may still feed update 1: 1 - 0 <= 1
    second = s.fill()
    assert [x.group_id for x in second] == ["g2", "g2"] and second[0].version == 1
    _finish_group(s, second, "g2", 2)
    # g1 expires at update 1 (1 - 0 = alpha): it is waited for, not dropped for the quicker g2
    # (dropping would bias batches towards groups that finish fast).
    assert s.take_batch(1) is None
    _finish_group(s, first, "g1", 2)
    assert list(s.take_batch(1)) == ["g1"]
    s.on_version(2)
    third = s.fill()
    assert [x.group_id for x in third] == ["g3", "g3"]
    # Past the bound: the engines move on to version 4 without updates 2 and 3 taking anything.
    cancels = s.on_version(4)  # g2 (v1, complete) and g3 (v2, running): 4 - 1, 4 - 2 > 1
    assert {c.episode_id for c in cancels} == {"g3/m0", "g3/m1"}
    assert {c.reason for c in cancels} == {"stale"}
    assert s.counters["dropped_stale_groups"] == 2
    assert s.discarded == [("g2/m0", "stale"), ("g2/m1", "stale")]
    # A result that arrives for a dropped episode is ignored, not counted twice.
    assert s.on_finished("g3/m0") == [] and s.counters["late_results"] == 1


def test_complete_group_that_went_stale_is_dropped_at_take_batch():
    s = RolloutScheduler(SchedulerConfig(group_size=1, batch_groups=2, max_staleness=0))
    starts = s.fill()
    _finish_group(s, starts, "g0", 1)
    s.version = 1  # engines moved on without this group being consumed
    assert s.take_batch(1) is None
    assert s.counters["dropped_stale_groups"] == 2 and s.complete == []


def test_redundancy_keeps_first_finishers_and_cancels_the_rest():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, redundancy=2))
    starts = s.fill()
    assert len(starts) == 4  # group_size + redundancy
    assert s.on_finished("g0/m3") == []
    cancels = s.on_finished("g0/m1")
    assert sorted(c.episode_id for c in cancels) == ["g0/m0", "g0/m2"]
    assert {c.reason for c in cancels} == {"redundant"}
    assert s.take_batch(0) == {"g0": ["g0/m3", "g0/m1"]}  # finishing order
    assert s.counters["cancelled_redundant"] == 2


def test_failure_reissues_same_group_and_seed_then_gives_up():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, max_retries=1),
                         group_of=lambda task, i: (f"g{i}", 100 + i))
    starts = s.fill()
    assert {x.seed for x in starts} == {100}
    again, cancels = s.on_failed("g0/m0")
    assert cancels == [] and len(again) == 1
    assert (again[0].group_id, again[0].seed, again[0].episode_id) == ("g0", 100, "g0/m2")
    assert s.counters["failed"] == 1 and s.counters["retried"] == 1
    s.on_failed("g0/m2", timeout=True)  # failure 2 of a budget of 1 * group_size
    _, cancels = s.on_failed("g0/m3")  # failure 3: budget exceeded, group dropped
    assert s.counters["timeouts"] == 1
    assert "g0" not in s.groups and [c.reason for c in cancels] == ["group_dropped"]
    # 3 failures = 2 re-issued + the one that spent the budget
    assert (s.counters["failed"], s.counters["retried"], s.counters["groups_dropped_failures"]) \
        == (2, 2, 1)
    assert [x.group_id for x in s.fill()] == ["g1", "g1"]  # capacity freed


def test_task_shares_split_groups():
    cfg = SchedulerConfig(group_size=1, batch_groups=8, task_shares=(("a", 3.0), ("b", 1.0)))
    starts = RolloutScheduler(cfg).fill()
    tasks = [x.task for x in starts]
    assert tasks.count("a") == 6 and tasks.count("b") == 2


def test_async_alpha1_keeps_a_batch_running_while_update_runs():
    s = RolloutScheduler(SchedulerConfig(group_size=1, batch_groups=1, max_staleness=1))
    first = s.fill()  # two batches may exist under version 0 (for updates 0 and 1)
    assert [(x.group_id, x.iteration) for x in first] == [("g0", 0), ("g1", 1)]
    s.on_finished("g1/m0")  # the later group finishes first: it may feed update 0
    assert list(s.take_batch(0)) == ["g1"]
    # Update 0 trains now; g0 keeps running. A group begun now (version 0) could feed update 1
    # only, which g0 already covers: nothing starts that is bound to go stale.
    assert s.fill() == []
    s.on_version(1)
    assert [(x.group_id, x.version) for x in s.fill()] == [("g2", 1)]
    s.on_finished("g0/m0")
    assert list(s.take_batch(1)) == ["g0"]  # 1 - 0 <= 1
    for v in range(2, 6):  # steady state: each update takes the batch begun one version ago
        s.on_version(v)
        started = s.fill()
        s.on_finished(f"g{v}/m0")
        assert list(s.take_batch(v)) == [f"g{v}"] and len(started) == 1
    assert s.counters["dropped_stale_groups"] == 0


def test_group_namer_and_discarded_finishers_of_a_dropped_group():
    names = lambda task, i: (f"{task}/i{i // 2}/g{i % 2}", 7)  # noqa: E731
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=2, max_staleness=0,
                                         task_shares=(("task", 1.0),)), group_of=names)
    starts = s.fill()
    assert [x.episode_id for x in starts][:2] == ["task/i0/g0/m0", "task/i0/g0/m1"]
    s.on_finished("task/i0/g1/m0")  # one of two members finished
    s.version = 1  # the engines moved on: the group is stale at update 1
    s.take_batch(1)
    assert s.discarded == [("task/i0/g1/m0", "stale")]


def test_consecutive_failures_halt_and_a_finisher_resets_the_count():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=2, max_retries=5,
                                         max_consecutive_failures=3),
                         group_of=lambda task, i: (f"g{i}", i))
    s.fill()  # g0/m0, g0/m1, g1/m0, g1/m1
    s.on_failed("g0/m0")
    s.on_failed("g0/m1")
    s.on_finished("g1/m0")  # one success in between: the streak starts over
    assert s.consecutive_failures == 0 and not s.halted
    # A lost worker fails a whole host's episodes at once: that is routed around, not a streak.
    s.on_failed("g1/m1", worker_lost=True)
    assert s.consecutive_failures == 0
    again1, _ = s.on_failed("g0/m2")
    again2, _ = s.on_failed("g0/m3")
    assert len(again1) == len(again2) == 1 and not s.halted
    again3, _ = s.on_failed("g1/m2")  # third in a row: halted, nothing re-issued or started
    assert s.halted and again3 == [] and s.fill() == []
    assert s.counters["failed"] == 6


def test_zero_disables_the_consecutive_failure_halt():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, max_retries=100,
                                         max_consecutive_failures=0),
                         group_of=lambda task, i: (f"g{i}", i))
    s.fill()
    for k in range(50):
        s.on_failed(f"g0/m{k}")
    assert not s.halted and s.consecutive_failures == 50


def test_unconsumed_groups_survive_export_and_import_with_new_member_ids():
    """What a checkpoint carries for an async run (rollart/rollout/snapshot.py)."""
    import json

    cfg = SchedulerConfig(group_size=2, batch_groups=1, max_staleness=1)
    s = RolloutScheduler(cfg)
    starts = s.fill()  # g0, g1 under version 0
    _finish_group(s, starts, "g0", 2)  # g0 complete; g1 has one member finished
    s.on_finished("g1/m0")
    state = json.loads(json.dumps(s.export_state()))  # as stored: JSON
    assert {g["group_id"]: g["running"] for g in state["groups"]} == {"g0": [], "g1": ["g1/m1"]}

    fresh = RolloutScheduler(cfg)
    relaunch = fresh.import_state(state)
    # g1 needs one more finisher: a new id (m2), never the interrupted m1 again.
    assert [(x.episode_id, x.version) for x in relaunch] == [("g1/m2", 0)]
    assert fresh.fill() == []  # both groups are back: nothing new starts
    assert fresh.take_batch(0) == {"g0": ["g0/m0", "g0/m1"]}
    fresh.on_finished("g1/m2")
    fresh.on_version(1)
    assert fresh.take_batch(1) == {"g1": ["g1/m0", "g1/m2"]}
    assert [x.group_id for x in fresh.fill()] == ["g2", "g2"]  # the plan cursor continued


def test_scheduler_and_simulator_take_the_rollout_defaults_from_the_config():
    """One home per default: `rollout.*` in RolloutConfig; the scheduler and the simulator agree."""
    import dataclasses

    from rollart.config import RolloutConfig, load_config
    from rollart.sim.workload import SimConfig

    r = RolloutConfig()
    sched = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    for name in ("max_staleness", "redundancy", "max_retries", "max_consecutive_failures"):
        assert sched[name] == getattr(r, name), name
    sim = {f.name: f.default for f in dataclasses.fields(SimConfig)}
    for name in ("group_size", "num_groups", "max_staleness", "redundancy", "max_retries",
                 "max_consecutive_failures", "batching"):
        assert sim[name] == getattr(r, name), name
    cfg = load_config(None, ["rollout.max_consecutive_failures=7", "rollout.redundancy=1"])
    s = SchedulerConfig.from_rollout(cfg.rollout, task_shares=(("t", 1.0),), max_updates=3)
    assert (s.group_size, s.batch_groups, s.redundancy, s.max_consecutive_failures,
            s.max_updates) == (cfg.rollout.group_size, cfg.rollout.num_groups, 1, 7, 3)


def _score_group(s: RolloutScheduler, starts: list[Start], gid: str,
                 rewards: list[float | None]) -> list[Cancel]:
    out: list[Cancel] = []
    for st, r in zip([x for x in starts if x.group_id == gid], rewards, strict=False):
        out += s.on_finished(st.episode_id, r)
    return out


def test_resample_uniform_replaces_a_group_that_scored_alike_up_to_its_budget():
    s = RolloutScheduler(
        SchedulerConfig(group_size=2, batch_groups=2, resample_uniform=2, redundancy=1),
        resample_of=lambda first, k: (f"{first}+{k}", 100 * k))
    starts = s.fill()  # g0, g1: three members each (redundancy 1)
    # g1 scores 0 and 1: it has signal, so it is kept (and its redundant member cancelled).
    assert _score_group(s, starts, "g1", [0.0, 1.0]) == [Cancel("g1/m2", "redundant")]
    # g0 scores 1 and 1: set aside, its third member cancelled, a fresh try of its slot
    # started under the current version, with a new id and seed; no other group starts.
    cancels = _score_group(s, starts, "g0", [1.0, 1.0])
    assert cancels == [Cancel("g0/m2", "uniform")]
    assert s.discarded == [("g0/m0", "uniform"), ("g0/m1", "uniform")]
    assert s.take_batch(0) is None  # the slot is open again
    again = s.fill()
    assert [(x.group_id, x.seed, x.version) for x in again] == [("g0+1", 100, 0)] * 3
    assert s.fill() == []
    # Second try scores alike too: replaced again, named from the slot's first id.
    _score_group(s, again, "g0+1", [0.0, 0.0])
    third = s.fill()
    assert {x.group_id for x in third} == {"g0+2"} and third[0].seed == 200
    # The budget (2) is spent: the third try is kept even though it scored alike.
    _score_group(s, third, "g0+2", [0.5, 0.5])
    assert s.fill() == []
    batch = s.take_batch(0)
    assert batch is not None and sorted(batch) == ["g0+2", "g1"]
    assert s.counters["groups_resampled"] == 2
    assert s.counters["groups_consumed"] == 2


def test_resample_uniform_never_on_unknown_rewards_and_off_by_default():
    s = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1, resample_uniform=3))
    starts = s.fill()
    _score_group(s, starts, "g0", [None, None])  # rewards not known: kept
    assert list(s.take_batch(0)) == ["g0"]
    off = RolloutScheduler(SchedulerConfig(group_size=2, batch_groups=1))
    starts = off.fill()
    _score_group(off, starts, "g0", [1.0, 1.0])
    assert list(off.take_batch(0)) == ["g0"] and off.counters["groups_resampled"] == 0


def test_resample_state_survives_export_and_import():
    import json

    cfg = SchedulerConfig(group_size=2, batch_groups=1, resample_uniform=1)
    s = RolloutScheduler(cfg)
    starts = s.fill()
    _score_group(s, starts, "g0", [1.0, 1.0])
    retry = s.fill()
    s.on_finished(retry[0].episode_id, 1.0)  # one member of the replacement finished
    state = json.loads(json.dumps(s.export_state()))
    fresh = RolloutScheduler(cfg)
    relaunch = fresh.import_state(state)
    assert [x.group_id for x in relaunch] == ["g0.r1"]
    # The replacement's budget is spent (redo 1 of 1): scoring alike again keeps it.
    fresh.on_finished(relaunch[0].episode_id, 1.0)
    assert list(fresh.take_batch(0)) == ["g0.r1"]
