"""rollout_metrics against hand-computed values, and the per-episode stats path the rollout
service takes (TrajStats computed when an episode ends) against the plain one."""

from rollart.metrics import rollout_metrics, task_metrics, traj_stats
from rollart.types import Trajectory, Turn


def _turn(i: int, action: str | None) -> Turn:
    return Turn(i, "obs", "resp", action, action is not None, 0.0, 3, 2, 0, 0.1, 0.1)


def _traj(name: str, task: str, turns: list[str | None], mask: list[int], *, success=False,
          ret=0.0, fmt=0, error=None) -> Trajectory:
    return Trajectory(name, task, "env", "g", 0, 0, list(range(len(mask))), mask,
                      [0.0] * len(mask), [0] * len(mask),
                      turns=[_turn(i, a) for i, a in enumerate(turns)], env_return=ret,
                      success=success, format_errors=fmt, error=error)


def batch() -> list[Trajectory]:
    return [
        # 2 turns, one without an action; 3 model tokens of 6; solved
        _traj("a", "t1", ["left", None], [0, 0, 1, 1, 0, 1], success=True, ret=1.0, fmt=1),
        # 3 turns, all acting; 2 model tokens of 4
        _traj("b", "t2", ["up", "up", "down"], [0, 1, 0, 1], ret=-0.5),
        # failed: counted as failed, left out of every rate and sum
        _traj("c", "t1", ["up"], [0, 1, 1, 1, 1], success=True, ret=9.0, error="env: boom"),
    ]


def test_rollout_metrics_hand_computed():
    m = rollout_metrics(batch())
    assert m["rollout/episodes"] == 3.0
    assert m["rollout/failed"] == 1.0
    assert m["rollout/success_rate"] == 0.5  # a solved, b not; c failed
    assert m["rollout/env_return"] == 0.25  # (1.0 - 0.5) / 2
    assert m["rollout/episode_len"] == 2.5  # (2 + 3) / 2
    assert m["rollout/no_action_rate"] == 1 / 5  # one of 5 turns
    assert m["rollout/format_error_rate"] == 1 / 5
    assert m["rollout/model_tokens"] == 5.0  # 3 + 2
    assert m["rollout/total_tokens"] == 10.0  # 6 + 4
    assert m["rollout/response_len"] == 1.0  # 5 model tokens over 5 turns
    assert m["rollout/prompt_len"] == 3.0  # 3 new prompt tokens before each turn


def test_per_task_figures_under_task_prefix():
    m = rollout_metrics(batch())
    t1, t2 = "rollout/task/t1", "rollout/task/t2"
    # t1: a (2 turns, solved) and c (failed: counted, left out of the rates)
    assert m[f"{t1}/episodes"] == 2.0 and m[f"{t1}/failed"] == 1.0
    assert m[f"{t1}/success_rate"] == 1.0 and m[f"{t1}/env_return"] == 1.0
    assert m[f"{t1}/episode_len"] == 2.0 and m[f"{t1}/format_error_rate"] == 0.5
    assert m[f"{t1}/response_len"] == 1.5  # 3 model tokens over 2 turns
    assert m[f"{t1}/prompt_len"] == 3.0
    assert m[f"{t2}/episodes"] == 1.0 and m[f"{t2}/success_rate"] == 0.0
    assert m[f"{t2}/env_return"] == -0.5 and m[f"{t2}/episode_len"] == 3.0
    assert m[f"{t2}/response_len"] == 2 / 3 and m[f"{t2}/format_error_rate"] == 0.0
    assert not any(k.startswith(("rollout/t1/", "rollout/t2/")) for k in m)  # old keys
    # evaluation: the same figures under eval/task/...
    ev = rollout_metrics(batch(), prefix="eval")
    assert ev["eval/task/t1/success_rate"] == 1.0 and ev["eval/task/t2/episodes"] == 1.0
    assert task_metrics(ev, "eval")["t2"]["episode_len"] == 3.0
    assert set(task_metrics(m)) == {"t1", "t2"}


def test_one_task_has_no_per_task_figures():
    one = [t for t in batch() if t.task == "t1"]
    assert not any("/task/" in k for k in rollout_metrics(one))
    # a task whose episodes all failed still has its figures (it is in the run)
    failed_only = batch()[1:]  # b (t2) and c (t1, failed)
    m = rollout_metrics(failed_only)
    assert m["rollout/task/t1/episodes"] == 1.0 and m["rollout/task/t1/failed"] == 1.0
    assert m["rollout/task/t1/success_rate"] == 0.0


def test_precomputed_stats_give_the_same_metrics():
    trajs = batch()
    stats = [traj_stats(t) for t in trajs]
    assert rollout_metrics(trajs, stats=stats) == rollout_metrics(trajs)
    assert rollout_metrics([], stats=[])["rollout/episodes"] == 0.0


def test_stats_keep_the_policy_version_of_the_first_turn():
    t = batch()[0]
    t.turns[0].weight_version, t.turns[1].weight_version = 4, 5
    assert traj_stats(t).start_version == 4
    t.turns = []  # an episode that failed before its first turn
    assert traj_stats(t).start_version == -1
