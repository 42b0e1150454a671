"""benchmarks/agentic_multitask.py's reading of a run's metrics rows: per-task eval success
before (iteration -1) and after, the training curve per task, and where each task's turns ran;
and a failed run's record (no rows yet) still says what it has."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import agentic_multitask as bench  # noqa: E402
from rollart.config import load_config  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2-agentic.yaml")


def rows() -> list[dict[str, float]]:
    before = {"iteration": -1, "eval/success_rate": 0.25, "eval/task/guess/success_rate": 0.5,
              "eval/task/guess/episodes": 8, "eval/task/calculator/success_rate": 0.0,
              "eval/task/calculator/episodes": 8}
    it = [{"iteration": i, "rollout/episodes": 16, "perf/iteration_s": 90.0 + i,
           "rollout/task/guess/success_rate": 0.2 + 0.1 * i,
           "rollout/task/calculator/success_rate": 0.1 * i,
           "rollout/task/guess/prompt_len": 42.0, "rollout/task/calculator/prompt_len": 140.0,
           "rollout/router/guess/turns_on/H20": 30.0 * (i + 1),
           "rollout/router/guess/turns_on/H800": 4.0,
           "rollout/router/calculator/turns_on/H800": 20.0 * (i + 1),
           "rollout/router/routed/engine-0": 24.0, "rollout/router/routed/engine-1": 60.0,
           "rollout/router/sticky": 44.0, "rollout/profile/guess/decode_tokens": 17.0}
          for i in range(3)]
    after = {"eval/success_rate": 0.5, "eval/task/guess/success_rate": 0.75,
             "eval/task/calculator/success_rate": 0.25}
    it[-1].update(after)
    return [before, *it]


def test_summary_per_task_before_after_and_routing():
    cfg = load_config(CONFIG, ["iterations=3"])
    s = bench.summarise(cfg, rows())
    guess, calc = s["tasks"]["guess"], s["tasks"]["calculator"]
    assert (guess["eval_success_before"], guess["eval_success_after"]) == (0.5, 0.75)
    assert (calc["eval_success_before"], calc["eval_success_after"]) == (0.0, 0.25)
    assert guess["train_success_curve"] == [0.2, 0.3, 0.4]
    assert guess["turns_on"] == {"H20": 90, "H800": 4} and calc["turns_on"] == {"H800": 60}
    assert guess["turns_on_per_iteration"] == [{"H20": 30, "H800": 4}, {"H20": 30, "H800": 0},
                                               {"H20": 30, "H800": 0}]
    assert calc["last_iteration"]["prompt_len"] == 140.0
    assert guess["profile"] == {"decode_tokens": 17.0}
    assert s["routing"]["replicas"]["engine-0"] == {"class": "H800", "routed": 24.0}
    assert s["routing"]["replicas"]["engine-1"]["class"] == "H20"
    assert s["routing"]["decisions"] == {"sticky": 44.0}
    assert s["iterations_done"] == 3 and s["iteration_s"]["median"] == 91.0
    out = {"status": "ok", "iterations_planned": 3, "wall_s": 300.0, **s}
    line = bench.one_line(out)
    assert "guess eval 0.50 -> 0.75 (turns H20:90/H800:4)" in line, line


def test_a_run_that_wrote_nothing_still_summarises():
    cfg = load_config(CONFIG, ["iterations=3"])
    s = bench.summarise(cfg, [])
    assert s["iterations_done"] == 0 and s["tasks"]["guess"]["eval_success_before"] is None
    out = {"status": "failed", "iterations_planned": 3, "error": "rollart train exited with 1",
           **s}
    assert "error: rollart train exited with 1" in bench.one_line(out)


def test_the_error_names_the_runs_own_cause():
    tail = ["Traceback (most recent call last):", "│ x │",
            "ImportError: cannot import name 'crc32' from 'rollart.storage.store' ", "(...)"]
    assert bench.cause(tail) == ": ImportError: cannot import name 'crc32' from " \
                                "'rollart.storage.store'"
    said = ["Run failed: Flow run encountered an exception: ValueError: boom", "Flow run: ..."]
    assert bench.cause(said) == ": Run failed: Flow run encountered an exception: ValueError: boom"
    assert bench.cause(["all fine"]) == ""


def test_cpu_seconds_per_row_are_differences_of_the_marks():
    rows = [{"iteration": -1}, {"iteration": 0}, {"iteration": 1}]
    marks = [{"rows": 1, "wall_s": 100.0, "cpu_s": 150.0},
             {"rows": 3, "wall_s": 400.0, "cpu_s": 600.0},  # two rows in one tick: the last
             {"rows": 9, "wall_s": 500.0, "cpu_s": 700.0}]  # rows it cannot see: skipped
    assert bench.cpu_per_iteration(rows, marks) == [
        {"iteration": -1, "wall_s": 100.0, "cpu_s": 150.0},
        {"iteration": 1, "wall_s": 300.0, "cpu_s": 450.0}]
    assert bench.group_cpu_s(-12345) == 0.0  # no such process group
