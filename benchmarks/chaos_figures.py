"""The chaos benchmark's figures (benchmarks/chaos.py): when the run reported each iteration,
what each injected fault cost, and how far the chaos run's learning is from the clean run's.

Learning figures of a run (from its metrics.jsonl): `final_eval` (the greedy evaluation at the
last iteration, `eval/success_rate`), `train_reward` (mean `reward/mean` over the last
`LAST_ITERATIONS` iterations), `first_solved` (the first iteration whose greedy evaluation
reached `SOLVED`). A pair is a clean run and a chaos run of the same config and seed; its gap is
clean minus chaos. `reward_gap` (the must-show) is the final greedy evaluation's gap.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.chaos_services import Watch

LAST_ITERATIONS = 5
SOLVED = 0.9


class Rows:
    """Progress reporter: when each iteration's row was reported (a restart reports again)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []
        self.first_greedy: int | None = None  # first iteration whose greedy eval was > 0
        self.done = threading.Event()

    def __call__(self, row: dict[str, Any]) -> None:
        self.rows.append((time.time(), int(row["iter"])))
        if self.first_greedy is None and row.get("eval") not in (None, "") \
                and float(row["eval"]) > 0:
            self.first_greedy = int(row["iter"])

    def reached(self, before: float | None = None) -> int:
        return max((i for t, i in self.rows if before is None or t < before), default=-1)

    def past(self, t0: float) -> float | None:
        """Seconds from t0 until an iteration past the one reached at t0 was done."""
        top = self.reached(t0)
        return next((t - t0 for t, i in self.rows if t > t0 and i > top), None)

    def after(self, t0: float) -> int:
        return sum(1 for t, _ in self.rows if t > t0)


def _s(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 1)


def fault_figures(f: dict[str, Any], out: dict[str, Any], rows: Rows,
                  drops: Counter[str], per_iteration: int) -> dict[str, Any]:
    t0, kind = f["injected_at"], f["kind"]
    r = out.get("rollout", {})
    e: dict[str, Any] = {"kind": kind, **{k: v for k, v in f.items() if k in (
        "worker", "replica", "down_s", "stopped_s")}, "at_iteration": f["reached"] + 1}
    if kind in ("lambda_restart", "s3_restart"):
        w: Watch = f["watch"]
        e["detected_s"] = _s(w.first(t0, False), t0)
        e["recovered_s"] = _s(w.first(f["restarted_at"], True), t0)
        e["calls_refused"] = w.count(t0, f["restarted_at"], False)
        e["run_past_it_s"] = rows.past(t0) and round(rows.past(t0), 1)
        e["episodes_lost"] = 0  # a reward or store call that gives up fails the whole run
    elif kind in ("trainer_kill", "trainer_rank_kill", "rollout_service_kill"):
        rs = [x for x in out.get("restarts", []) if x["failed_at"] >= t0]
        e["detected_s"] = _s(rs[0]["failed_at"], t0) if rs else None
        e["recovered_s"] = rows.past(t0) and round(rows.past(t0), 1)
        if rs:
            e.update(lost=rs[0]["lost"], from_checkpoint=rs[0]["from_checkpoint"],
                     iterations_redone=f["reached"] + 1 - rs[0]["from_checkpoint"])
            e["episodes_rerun"] = e["iterations_redone"] * per_iteration
        e["episodes_lost"] = 0  # rolled back with their updates, issued again (same ids)
    elif kind in ("engine_kill", "engine_hang"):
        ev = r.get("engine_events", [])
        lost = [x["t"] for x in ev if x["replica"] == f["replica"] and x["event"] == "lost"
                and x["t"] >= t0]
        back = [x for x in r.get("engines_revived", []) if x["replica"] == f["replica"]
                and x["t"] >= t0]
        e["detected_s"] = _s(lost[0], t0) if lost else None
        e["recovered_s"] = _s(back[0]["t"], t0) if back else None
        e["how"] = back[0]["how"] if back else None
        e["episodes_lost"] = drops.get("engine_error", 0)
    elif kind == "rollout_service_crash":  # rebuilt from its live state (else restarted)
        rb = [x for x in r.get("rebuilt", []) if x["failed_at"] >= t0]
        rs = [x for x in out.get("restarts", []) if x["failed_at"] >= t0]
        if rb:
            e.update(detected_s=_s(rb[0]["failed_at"], t0), recovered_s=_s(rb[0]["rebuilt_at"], t0),
                     how="live state", restored=rb[0]["restored"],
                     episodes_interrupted=rb[0]["restored"].get("interrupted", 0))
        else:
            e.update(detected_s=_s(rs[0]["failed_at"], t0) if rs else None,
                     recovered_s=rows.past(t0) and round(rows.past(t0), 1),
                     how="checkpoint" if rs else None)
        e["run_past_it_s"] = rows.past(t0) and round(rows.past(t0), 1)
        # members running at the crash are dropped as interrupted and re-issued (new ids)
        e["episodes_lost"] = e.get("episodes_interrupted", 0)
    else:  # env host
        ev = [x["t"] for x in r.get("host_events", []) if x["t"] >= t0]
        e["detected_s"] = _s(ev[0], t0) if ev else None
        done = [t for t, _ in rows.rows if ev and t > ev[0]]  # its episodes re-issued, done
        e["recovered_s"] = _s(done[0], t0) if done else None
        e["episodes_failed_reissued"] = r.get("counters", {}).get("failed", 0)
        e["episodes_lost"] = drops.get("host_lost", 0)
    e["recovered"] = e["detected_s"] is not None and e["recovered_s"] is not None
    return e


def learning(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's learning figures from its metrics rows (one per iteration, in order)."""
    evals = [(int(r["iteration"]), float(r["eval/success_rate"])) for r in metrics
             if "eval/success_rate" in r]
    out: dict[str, Any] = {
        "reward_curve": [round(float(r["reward/mean"]), 3) for r in metrics],
        "success_curve": [round(float(r.get("rollout/success_rate", 0.0)), 3) for r in metrics],
        "eval_curve": [[i, round(e, 3)] for i, e in evals],
        "final_eval": evals[-1][1] if evals else None,
        "first_solved": next((i for i, e in evals if e >= SOLVED), None),
        # learning has begun: the first greedy evaluation that solved any episode
        "first_success": next((i for i, e in evals if e > 0), None),
    }
    if len(metrics) >= LAST_ITERATIONS:
        last = metrics[-LAST_ITERATIONS:]
        out["train_reward"] = round(statistics.fmean(float(r["reward/mean"]) for r in last), 4)
        out["train_success"] = round(statistics.fmean(
            float(r.get("rollout/success_rate", 0.0)) for r in last), 4)
    return out


def _gap(clean: dict[str, Any], chaos: dict[str, Any], key: str) -> float | None:
    if clean.get(key) is None or chaos.get(key) is None:
        return None
    return round(float(clean[key]) - float(chaos[key]), 4)


def pair_gaps(clean: dict[str, Any], chaos: dict[str, Any]) -> dict[str, Any]:
    """Clean minus chaos, for one pair (same config, same seed)."""
    return {"final_eval_gap": _gap(clean, chaos, "final_eval"),
            "train_reward_gap": _gap(clean, chaos, "train_reward"),
            "train_success_gap": _gap(clean, chaos, "train_success"),
            "first_solved": {"clean": clean.get("first_solved"),
                             "chaos": chaos.get("first_solved")}}


def spread(xs: list[float | None]) -> dict[str, Any]:
    """Mean, min, max and sample stdev of the pairs' values (None: a run without the figure)."""
    vals = [float(x) for x in xs if x is not None]
    if not vals:
        return {"n": 0}
    return {"n": len(vals), "mean": round(statistics.fmean(vals), 4), "min": min(vals),
            "max": max(vals),
            "stdev": round(statistics.stdev(vals), 4) if len(vals) > 1 else None,
            "values": vals}
