"""The iteration driver (`rollart/runner/driver.py`) with recording fakes: which stages run each
step, in which order, with which arguments; checkpoint and evaluation cadence; the metric merge; the
rollout service learning the version after a checkpoint."""

from __future__ import annotations

from typing import Any

import pytest

from rollart.config import load_config
from rollart.run import RunSpec
from rollart.runner.driver import Done, IterationDriver, plan_step


def cfg_with(tmp_path, *overrides: str):
    return load_config(None, [f"storage.root={tmp_path}", *overrides])


@pytest.mark.parametrize(("iterations", "save_every", "every", "episodes", "ckpt", "evals"), [
    (5, 2, 2, 4, [2, 4, 5], [2, 4, 5]),   # cadence, and the last step always
    (5, 10, 0, 4, [5], [5]),              # eval.every 0: only the last step
    (3, 1, 1, 0, [1, 2, 3], []),          # no eval episodes: never evaluate
])
def test_plan_step_cadence(tmp_path, iterations, save_every, every, episodes, ckpt, evals):
    cfg = cfg_with(tmp_path, f"iterations={iterations}", f"storage.save_every={save_every}",
                   f"eval.every={every}", f"eval.episodes={episodes}")
    plans = [plan_step(cfg, it) for it in range(iterations)]
    assert [p.step for p in plans] == list(range(1, iterations + 1))
    assert [p.step for p in plans if p.checkpoint] == ckpt
    assert [p.step for p in plans if p.evaluate] == evals


class Rollout:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def start(self) -> dict[str, Any]:
        self.log.append(("rollout.start",))
        return {"worker": "CPU-0", "resources": {"CPU": 1}}

    def set_version(self, v: int) -> None:
        self.log.append(("rollout.set_version", v))

    def stop(self) -> dict[str, Any]:
        self.log.append(("rollout.stop",))
        return {"counters": {}}


class Trainer:
    def flush_checkpoints(self) -> list[Any]:
        return ["up"]

    def fingerprint(self) -> float:
        return 1.5

    def close(self) -> None:
        self.closed = True


class Engine:
    def fingerprint(self) -> float:
        return 1.5


class Factory:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def trainer(self) -> Trainer:
        self.log.append(("trainer",))
        return Trainer()

    def engines(self) -> list[Engine]:
        return [Engine()]

    def env_hosts(self) -> list[str]:
        return ["host"]

    def rollout(self, engines: list[Any], hosts: list[Any], version: int) -> Rollout:
        self.log.append(("rollout", version))
        return Rollout(self.log)

    def host_stats(self, hosts: list[Any]) -> list[dict[str, Any]]:
        return [{"live_envs": 0}]

    def flush_shards(self) -> int:
        return 3


class Runner:
    """Records (stage, args) and answers what each stage returns, with one metric each."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def submit(self, stage: str, *args: Any, after: Any = ()) -> Done:
        args = tuple(a.result() if isinstance(a, Done) else a for a in args)
        self.log.append((stage, *[a for a in args if isinstance(a, int | type(None))]))
        info = {"worker": stage, "resources": {}, "metrics": {f"perf/{stage}": 1.0}}
        if stage in ("collect", "score"):
            return Done(([], info))
        if stage == "checkpoint":
            return Done({**info, "save_s": 0.25, "path": f"ckpt-{args[1]}",
                         "uploaded": [{"result": {"upload_s": 0.5}}]})
        return Done(info)

    def info(self, pending: Done) -> dict[str, Any]:
        v = pending.result()
        return v[1] if isinstance(v, tuple) else v


def test_driver_runs_the_stages_in_order_and_merges_metrics(tmp_path):
    cfg = cfg_with(tmp_path, "iterations=3", "storage.save_every=2", "eval.every=0",
                   "eval.episodes=2")
    log: list[Any] = []
    driver = IterationDriver(RunSpec(cfg, "r"), Runner(log), Factory(log))
    first = driver.start()
    assert first == 0
    curve = driver.iterations(first)
    done = driver.finish()
    assert log == [
        ("prepare",), ("trainer",), ("sync_weights",), ("rollout", 0), ("rollout.start",),
        # step 1: no checkpoint -> sync tells the rollout service (its handle is passed)
        ("collect", 0), ("score", 0), ("update", 1), ("sync_weights", 1),
        # step 2: checkpoint -> sync without the rollout service; it learns after the snapshot
        ("collect", 1), ("score", 1), ("update", 2), ("sync_weights", None, 2),
        ("checkpoint", 2), ("rollout.set_version", 2),
        # step 3 (last): checkpoint and evaluation
        ("collect", 2), ("score", 2), ("update", 3), ("sync_weights", None, 3),
        ("checkpoint", 3), ("evaluate", 2), ("rollout.set_version", 3),
        ("rollout.stop",),
    ]
    assert [m["iteration"] for m in curve] == [0.0, 1.0, 2.0]
    assert [m["version"] for m in curve] == [1.0, 2.0, 3.0]
    assert "perf/evaluate" in curve[2] and "perf/evaluate" not in curve[1]
    assert curve[1]["perf/checkpoint_s"] == 0.25 and curve[1]["perf/checkpoint_upload_s"] == 0.5
    assert "perf/checkpoint_s" not in curve[0]
    for m in curve:
        assert {"perf/collect", "perf/score", "perf/update", "perf/sync_weights",
                "perf/iteration_s", "perf/elapsed_s"} <= set(m)
    # what the run wrote is what the driver returned
    assert driver.store.read_jsonl("metrics.jsonl") == curve
    assert done["shards_flushed"] == 3 and done["uploads"] == ["up"]
    assert done["fingerprints"] == {"trainer": 1.5, "engine": 1.5}
    assert done["rollout"]["env_hosts"] == [{"live_envs": 0}]
    assert [r["worker"] for r in driver.placed.by_stage["checkpoint"]] == ["checkpoint"] * 2


class AheadFactory(Factory):
    """A factory that builds its engines ahead (BuildsAhead)."""

    def begin(self) -> None:
        self.log.append(("begin",))


@pytest.mark.parametrize(("overrides", "order"), [
    # the run's own tokenizer is what prepare writes: the engines wait for it
    ((), [("prepare",), ("begin",), ("trainer",)]),
    # an HF directory brings its tokenizer: the engines start before prepare
    (("model.source=hf_dir", "model.path=/models/x"), [("begin",), ("prepare",), ("trainer",)]),
])
def test_engines_start_before_prepare_only_when_they_do_not_need_it(tmp_path, overrides, order):
    log: list[Any] = []
    IterationDriver(RunSpec(cfg_with(tmp_path, *overrides), "r"), Runner(log),
                    AheadFactory(log)).start()
    assert log[:3] == order


def test_eval_before_training_evaluates_the_initial_policy_first(tmp_path):
    """`eval.before_training`: one evaluation after the first sync and before the rollout
    service starts, written as the row of iteration -1 (version 0)."""
    cfg = cfg_with(tmp_path, "iterations=1", "eval.every=0", "eval.episodes=2",
                   "eval.before_training=true")
    log: list[Any] = []
    driver = IterationDriver(RunSpec(cfg, "r"), Runner(log), Factory(log))
    driver.iterations(driver.start())
    assert log[:5] == [("prepare",), ("trainer",), ("sync_weights",), ("evaluate", 2),
                       ("rollout", 0)]
    rows = driver.store.read_jsonl("metrics.jsonl")
    assert rows[0]["iteration"] == -1.0 and rows[0]["version"] == 0.0
    assert "perf/evaluate" in rows[0] and [r["iteration"] for r in rows[1:]] == [0.0]


def test_driver_stop_when_ends_the_run_early(tmp_path):
    cfg = cfg_with(tmp_path, "iterations=10", "storage.save_every=100", "eval.episodes=2")
    log: list[Any] = []

    class EvalRunner(Runner):
        def submit(self, stage: str, *args: Any, after: Any = ()) -> Done:
            out = super().submit(stage, *args, after=after)
            if stage == "evaluate":
                out.value["metrics"]["eval/success_rate"] = 1.0
            return out

    driver = IterationDriver(RunSpec(cfg, "r"), EvalRunner(log), Factory(log), eval_every=2)
    curve = driver.iterations(driver.start(), stop_when=lambda evals: len(evals) >= 2)
    assert len(curve) == 4  # evaluations after steps 2 and 4, then stop


def test_eval_stop_at_stops_after_consecutive_evals_and_checkpoints(tmp_path):
    """eval.stop_at 0.9 / stop_after 2: evaluations 0.95, 0.5, 0.9, 1.0 (every 2 steps) stop
    the run after step 8, which is then checkpointed although it is off the save cadence."""
    cfg = cfg_with(tmp_path, "iterations=20", "storage.save_every=5", "eval.episodes=2",
                   "eval.every=2", "eval.stop_at=0.9", "eval.stop_after=2")
    scores = iter([0.95, 0.5, 0.9, 1.0])
    log: list[Any] = []

    class EvalRunner(Runner):
        def submit(self, stage: str, *args: Any, after: Any = ()) -> Done:
            out = super().submit(stage, *args, after=after)
            if stage == "evaluate":
                out.value["metrics"]["eval/success_rate"] = next(scores)
            return out

    driver = IterationDriver(RunSpec(cfg, "r"), EvalRunner(log), Factory(log))
    seen = []
    curve = driver.iterations(driver.start(), on_iteration=seen.append)
    assert len(curve) == 8
    assert [m.get("eval/stopped_early") for m in curve] == [None] * 7 + [1.0]
    ckpts = [e[1] for e in log if e[0] == "checkpoint"]
    assert ckpts == [5, 8]  # the cadence, then the stopping step
    assert seen[-1].checkpoint is not None and seen[-2].checkpoint is None
    assert log[-1] == ("rollout.set_version", 8)  # engines serve the saved version


def test_busy_seconds_and_orchestration_split():
    from rollart.runner.driver import control_plane_metrics
    from rollart.runner.spans import busy_seconds

    # [0,2] and [1,3] overlap -> [0,3]; [4,5] separate; clipped to the window [0.5, 4.5]
    assert busy_seconds([(0, 2), (1, 3), (4, 5)], 0.0, 10.0) == 4.0
    assert busy_seconds([(0, 2), (1, 3), (4, 5)], 0.5, 4.5) == 3.0
    assert busy_seconds([], 0.0, 1.0) == 0.0
    m = control_plane_metrics({"collect": {"span": (10.0, 11.0)}, "update": {"span": (11.5, 12.0)},
                               "score": {}}, 10.0, 12.5)
    assert m["perf/stage/collect_s"] == 1.0 and m["perf/stage/update_s"] == 0.5
    assert m["perf/stage_busy_s"] == 1.5
    assert m["perf/orchestration_s"] == 1.0 and m["perf/orchestration_share"] == 0.4


def test_metrics_go_to_tensorboard_when_asked(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = cfg_with(tmp_path, "iterations=2", "eval.episodes=0", "logging.tensorboard=true",
                   f"logging.tensorboard_dir={tmp_path / 'tb'}")
    log: list[Any] = []
    driver = IterationDriver(RunSpec(cfg, "tb-run"), Runner(log), Factory(log))
    curve = driver.iterations(driver.start())
    driver.finish()
    acc = EventAccumulator(str(tmp_path / "tb" / "tb-run"))
    acc.Reload()
    assert "perf/update" in acc.Tags()["scalars"] and "iteration" not in acc.Tags()["scalars"]
    got = [(e.step, e.value) for e in acc.Scalars("perf/iteration_s")]
    assert [s for s, _ in got] == [1, 2]
    assert [v for _, v in got] == pytest.approx([m["perf/iteration_s"] for m in curve])
