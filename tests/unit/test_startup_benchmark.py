"""benchmarks/startup.py: its summary against hand-computed medians and ratios."""

from __future__ import annotations

import pytest

from benchmarks.startup import summarise


def _run(startup: float, finish: float = 5.0, first: float = 6.0) -> dict[str, float]:
    return {"startup_s": startup, "finish_s": finish, "wall_s": startup + first + finish,
            "first_iteration_s": first}


def test_summary_takes_medians_and_pairs_the_rounds():
    runs = {"baseline": [_run(30.0), _run(24.0), _run(27.0)],
            "this": [_run(20.0), _run(22.0), _run(18.0, finish=4.0)]}
    out = summarise(runs)
    assert out["median"]["baseline"]["startup_s"] == 27.0
    assert out["median"]["this"]["startup_s"] == 20.0
    assert out["median"]["this"]["finish_s"] == 5.0
    assert out["startup_speedup"] == pytest.approx(27.0 / 20.0)
    assert out["startup_saved_s"] == pytest.approx(7.0)
    # round k pairs the k-th run of each checkout: 30/20, 24/22, 27/18
    assert out["startup_speedup_per_round"] == pytest.approx([1.5, 24 / 22, 1.5])
