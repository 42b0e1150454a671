"""Episode ids: one scheme, formatted and parsed in rollart/rollout/ids.py."""

from __future__ import annotations

import pytest

from rollart.config import load_config
from rollart.rollout.ids import (
    eval_id,
    group_id,
    group_of_sample,
    parse_group_id,
    parse_sample_id,
    sample_id,
)
from rollart.rollout.plan import (
    group_seed,
    plan_eval,
    plan_iteration,
    plan_namer,
    plan_resampler,
)
from rollart.rollout.scheduler import RolloutScheduler, SchedulerConfig


def test_format_and_parse_round_trip():
    assert group_id("lake", 3, 1) == "lake/i3/g1"
    assert sample_id("lake/i3/g1", 0) == "lake/i3/g1/m0"
    assert parse_sample_id("lake/i3/g1/m12") == ("lake/i3/g1", 12)
    assert parse_group_id("lake/i3/g1") == ("lake", 3, 1)
    # a task name with "/", "/i" and "/m" in it still parses from the right
    gid = group_id("suite/imgs/math", 10, 2)
    assert parse_group_id(gid) == ("suite/imgs/math", 10, 2)
    assert group_of_sample(sample_id(gid, 7)) == gid
    assert eval_id("eval", "lake", 4) == "eval/lake/4"


@pytest.mark.parametrize("bad", ["lake/i3/g1", "lake/i3/g1/mx", "m3"])
def test_parse_sample_id_rejects_non_sample_ids(bad):
    with pytest.raises(ValueError, match="not a sample id"):
        parse_sample_id(bad)


@pytest.mark.parametrize("bad", ["lake/g1", "lake/i3", "lake/ix/g1", "g1"])
def test_parse_group_id_rejects_non_group_ids(bad):
    with pytest.raises(ValueError, match="not a group id"):
        parse_group_id(bad)


def test_plan_scheduler_and_service_name_the_same_samples():
    cfg = load_config("configs/default.yaml", ["rollout.num_groups=2", "rollout.group_size=2"])
    task = cfg.tasks[0].name
    planned = [s.sample_id for s in plan_iteration(cfg, 1)]
    assert planned == [f"{task}/i1/g0/m0", f"{task}/i1/g0/m1",
                       f"{task}/i1/g1/m0", f"{task}/i1/g1/m1"]
    assert [parse_sample_id(s) for s in planned][1] == (f"{task}/i1/g0", 1)
    # the async scheduler with the service's namer, resumed at iteration 1, launches exactly
    # those ids (and the same seeds) for its first batch
    sched = RolloutScheduler(
        SchedulerConfig(group_size=2, batch_groups=2, max_staleness=0,
                        task_shares=((task, 1.0),)),
        version=1, group_of=plan_namer(cfg), first_iteration=1)
    starts = sched.fill()
    assert [s.episode_id for s in starts] == planned
    assert [s.seed for s in starts] == [s.seed for s in plan_iteration(cfg, 1)]
    assert [s.sample_id for s in plan_eval(cfg, 2)] == [eval_id("eval", task, 0),
                                                        eval_id("eval", task, 1)]


def test_eval_spreads_over_every_task_by_share():
    """Held-out evaluation reports every task: episodes split by share, at least one per task
    while there are enough (a small share alone would round a task away)."""
    from rollart.rollout.plan import eval_counts

    two = ("tasks=[{name: a, env_id: FrozenLake-v1, share: 0.9}, "
           "{name: b, env_id: FrozenLake-v1, share: 0.1}]")
    cfg = load_config(None, [two, "rollout.num_groups=10"])  # b trains: 1 group of 10
    by_task = [s.task.name for s in plan_eval(cfg, 4)]
    assert by_task == ["a", "a", "a", "b"]  # by share alone: 4 and 0
    assert [s.seed for s in plan_eval(cfg, 4)][-1] == cfg.tasks[1].eval_seed_offset
    assert eval_counts(32, [0.9, 0.1]) == [29, 3]  # enough for both: the plain share split
    assert eval_counts(6, [1.0, 1.0, 1.0]) == [2, 2, 2]
    assert eval_counts(3, [10.0, 1.0, 1.0]) == [1, 1, 1]
    assert eval_counts(1, [1.0, 1.0]) == [1, 0]  # fewer episodes than tasks: by share
    assert sum(eval_counts(7, [5.0, 0.01, 0.01, 2.0])) == 7
    assert min(eval_counts(7, [5.0, 0.01, 0.01, 2.0])) == 1


def test_resampled_groups_get_fresh_parseable_ids_and_seeds():
    """A batch slot's replacements (rollout.resample_uniform) take indices past every planned
    group of any task, so ids never collide, and their seeds are the plan's at that index."""
    two = ("tasks=[{name: a, env_id: FrozenLake-v1, share: 1}, "
           "{name: b, env_id: FrozenLake-v1, share: 1}]")
    cfg = load_config(None, [two, "rollout.num_groups=4"])
    planned = {s.group_id for it in range(3) for s in plan_iteration(cfg, it)}
    name = plan_resampler(cfg)
    redo = {name(gid, k) for gid in planned for k in (1, 2)}
    assert len({g for g, _ in redo}) == 2 * len(planned)
    assert not {g for g, _ in redo} & planned
    gid, seed = name("b/i2/g1", 2)
    assert gid == "b/i2/g9" and parse_group_id(gid) == ("b", 2, 9)
    assert seed == group_seed(cfg, cfg.tasks[1], 2, 9)
