"""Two agentic tasks in one training run (configs/smollm2-agentic.yaml): success per task before
and after, and where each task's turns ran.

Runs the config as a user would, `rollart train --config configs/smollm2-agentic.yaml` (the
Prefect flow on the embedded Dask cluster), with `eval.before_training` so the base model's
greedy held-out success is measured per task (`eval/task/<name>/success_rate` of iteration -1)
next to the trained policy's at the end. From the run's metrics.jsonl it records per task: eval
success before/after, train success over the iterations, the turn profile (prefill and decode
tokens per turn) and the router's placement (`rollout/router/<task>/turns_on/<class>`:
which engine pool served the task's turns), plus the command and host facts. Writes
results/agentic_multitask.json and prints one line.

    rollart models fetch smollm2-135m-instruct     # once
    nice -n 19 .venv/bin/python benchmarks/agentic_multitask.py            # ~20-40 min here
    .venv/bin/python benchmarks/agentic_multitask.py --iterations 2 --out /tmp/smoke.json

Robust: the JSON is written before the run starts (status "running") and again whatever
happens (status "ok" or "failed" with the error, the exit code, the log's tail and every metrics
row the run wrote). A run that stopped can be continued from its last checkpoint with
`--resume RUN_ID` (the same command otherwise); the figures then cover the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollart.config import ConfigError, RunConfig, load_config  # noqa: E402
from rollart.metrics import task_metrics  # noqa: E402
from rollart.storage.store import RunStore  # noqa: E402

CURVE_KEYS = ("iteration", "version", "reward/mean", "rollout/success_rate", "train/entropy",
              "perf/iteration_s", "eval/success_rate")
TICK_S = 10.0  # how often the run's progress and CPU time are sampled
TASK_FIGURES = ("success_rate", "env_return", "episode_len", "format_error_rate",
                "response_len", "prompt_len", "episodes")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def host_facts() -> dict[str, Any]:
    """What a reader needs to compare this run with another: CPU, cores, boot (same machine
    session or not), code version, date."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    return {
        "cpu_model": cpu, "nproc": os.cpu_count(), "boot_id": _read(
            "/proc/sys/kernel/random/boot_id"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_start": _read("/proc/loadavg"), "python": platform.python_version(),
        "nice": os.nice(0),
    }


def run_command(args: argparse.Namespace, run_id: str) -> list[str]:
    """The `rollart train` command line (the user's entry point: CLI -> Prefect flow)."""
    cli = Path(sys.executable).with_name("rollart")
    cmd = [str(cli), "train", "--config", args.config, "--run-id", run_id]
    if args.resume:
        cmd += ["--resume", run_id]
    for item in overrides(args):
        cmd += ["--set", item]
    return cmd


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["eval.before_training=true"]  # the base model's per-task success (iteration -1)
    if args.iterations is not None:
        out.append(f"iterations={args.iterations}")
    return out + list(args.set)


def eval_row(rows: list[dict[str, Any]], before: bool) -> dict[str, Any] | None:
    """The evaluation before training (iteration -1), or the last one after it."""
    evals = [r for r in rows if "eval/success_rate" in r
             and (r.get("iteration", 0) < 0) == before]
    return evals[0 if before else -1] if evals else None


def per_task_eval(row: dict[str, Any] | None, tasks: list[str]) -> dict[str, dict[str, float]]:
    """{task: eval figures}; a one-task run has only the overall keys."""
    if row is None:
        return {}
    by_task = task_metrics(row, "eval")
    if not by_task and len(tasks) == 1:
        by_task = {tasks[0]: {k.split("/", 1)[1]: v for k, v in row.items()
                              if k.startswith("eval/")}}
    return by_task


def turns_on_of(row: dict[str, Any], task: str) -> dict[str, int]:
    """{hardware class: turns of `task` the router placed there so far} of one metrics row."""
    head = f"rollout/router/{task}/turns_on/"
    return {k[len(head):]: int(v) for k, v in row.items() if k.startswith(head)}


def summarise(cfg: RunConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-task and routing figures of a run's metrics rows."""
    names = [t.name for t in cfg.tasks]
    train = [r for r in rows if r.get("iteration", -1) >= 0 and "rollout/episodes" in r]
    before = per_task_eval(eval_row(rows, True), names)
    after = per_task_eval(eval_row(rows, False), names)
    last = train[-1] if train else {}
    classes = cfg.cluster.engine_classes(cfg.engine.replicas)
    tasks: dict[str, Any] = {}
    for t in cfg.tasks:
        curve = [task_metrics(r).get(t.name, {}) for r in train]
        success = [c["success_rate"] for c in curve if "success_rate" in c]
        placed = [turns_on_of(r, t.name) for r in train]  # cumulative since the start
        turns_on = placed[-1] if placed else {}
        tasks[t.name] = {
            "env_id": t.env_id, "share": t.share, "max_turns": t.max_turns,
            "constrained": t.constrained, "env_kwargs": t.env_kwargs,
            "eval_success_before": before.get(t.name, {}).get("success_rate"),
            "eval_success_after": after.get(t.name, {}).get("success_rate"),
            "eval_episodes": (before.get(t.name, {}).get("episodes"),
                              after.get(t.name, {}).get("episodes")),
            "train_success_curve": [round(s, 4) for s in success],
            "train_success_first_last": (success[0], success[-1]) if success else None,
            "last_iteration": {f: curve[-1].get(f) for f in TASK_FIGURES} if curve else {},
            "profile": {k.rsplit("/", 1)[1]: v for k, v in last.items()
                        if k.startswith(f"rollout/profile/{t.name}/")},
            "turns_on": turns_on,
            # per iteration (differences of the cumulative counts): placement can change as
            # the task profiles move with learning
            "turns_on_per_iteration": [
                {c: n - (placed[i - 1].get(c, 0) if i else 0) for c, n in p.items()}
                for i, p in enumerate(placed)],
        }
    routing = {
        "policy": cfg.routing.policy,
        "replicas": {f"engine-{i}": {"class": c, "routed": last.get(
            f"rollout/router/routed/engine-{i}")} for i, c in enumerate(classes)},
        "decisions": {k.removeprefix("rollout/router/"): v for k, v in last.items()
                      if k.startswith("rollout/router/") and k.count("/") == 2
                      and "/routed/" not in k and "/wait_s/" not in k},
        "turns_on": {n: tasks[n]["turns_on"] for n in names},
    }
    iter_s = [r["perf/iteration_s"] for r in train if "perf/iteration_s" in r]
    return {
        "iterations_done": len(train), "tasks": tasks, "routing": routing,
        "iteration_s": {"values": [round(s, 1) for s in iter_s],
                        "median": round(statistics.median(iter_s), 1) if iter_s else None,
                        "mean_after_first": round(statistics.fmean(iter_s[1:]), 1)
                        if len(iter_s) > 1 else None},
        "curve": [{k: r[k] for k in CURVE_KEYS if k in r} for r in rows],
    }


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def one_line(out: dict[str, Any]) -> str:
    parts = [f"agentic_multitask: {out['status']}",
             f"{out.get('iterations_done', 0)}/{out['iterations_planned']} it",
             f"{out.get('wall_s', 0) / 60:.1f} min"]
    for name, t in out.get("tasks", {}).items():
        b, a = t.get("eval_success_before"), t.get("eval_success_after")
        on = "/".join(f"{c}:{n}" for c, n in sorted(t.get("turns_on", {}).items()))
        parts.append(f"{name} eval {_rate(b)} -> {_rate(a)} (turns {on or '-'})")
    if out.get("error"):
        parts.append(f"error: {out['error'][:160]}")
    return "; ".join(parts)


def cause(log_tail: list[str]) -> str:
    """": <the run's own one-line error>" from the log's tail: the CLI's `error:` / `Run
    failed:` line, else the last exception line (`SomeError: ...`), else nothing."""
    said = [ln.strip() for ln in log_tail if ln.startswith(("error:", "Run failed:"))]
    raised = [ln.strip() for ln in log_tail
              if ln[:1].isalpha() and ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    found = said or raised[-1:]
    return "".join(f": {ln}" for ln in found)[:600]


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system, with reaped children's) of the live processes in process
    group `pgid`: the run's own work, whatever else the host runs (the wall time is not)."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[2]) == pgid:  # pgrp; then utime, stime, cutime, cstime (proc(5))
            ticks += sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_train(cmd: list[str], log_path: Path, timeout_s: float, store: RunStore,
              marks: list[dict[str, float]],
              on_rows: Callable[[list[dict[str, Any]]], None] = lambda rows: None
              ) -> int | None:
    """Run `cmd` with its output in `log_path`; its exit code, or None past `timeout_s`. The
    run gets a process group of its own, so stopping it (timeout, Ctrl-C) also stops the Dask
    workers it started, never anything else. Each time the run appends metrics rows, `marks`
    gets {rows, wall_s, cpu_s} (the run's CPU seconds so far: per-iteration work independent
    of the host's other load) and `on_rows(rows so far)` is called."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0, seen = time.perf_counter(), store.size("metrics.jsonl") or 0  # a resumed run's rows
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=TICK_S)
                except subprocess.TimeoutExpired:
                    pass
                else:  # the rows appended since the last tick: CPU of the reaped run
                    if (store.size("metrics.jsonl") or 0) != seen:
                        rows = store.read_jsonl_torn("metrics.jsonl")[0]
                        used = resource.getrusage(resource.RUSAGE_CHILDREN)
                        marks.append({"rows": len(rows),
                                      "wall_s": round(time.perf_counter() - t0, 1),
                                      "cpu_s": round(used.ru_utime + used.ru_stime, 1)})
                    return rc
                if time.perf_counter() - t0 > timeout_s:
                    stop(proc)
                    return None
                size = store.size("metrics.jsonl") or 0
                if size != seen:
                    seen, rows = size, store.read_jsonl_torn("metrics.jsonl")[0]
                    marks.append({"rows": len(rows),
                                  "wall_s": round(time.perf_counter() - t0, 1),
                                  "cpu_s": round(group_cpu_s(proc.pid), 1)})
                    on_rows(rows)
        except BaseException:
            stop(proc)
            raise


def cpu_per_iteration(rows: list[dict[str, Any]], marks: list[dict[str, float]]
                      ) -> list[dict[str, float]]:
    """[{iteration, wall_s, cpu_s}] per metrics row, from the marks taken as rows appeared:
    differences to the previous mark (the first one's includes the start-up)."""
    out, prev = [], {"wall_s": 0.0, "cpu_s": 0.0}
    for m in marks:
        if not 0 < m["rows"] <= len(rows):
            continue
        out.append({"iteration": rows[int(m["rows"]) - 1].get("iteration"),
                    "wall_s": round(m["wall_s"] - prev["wall_s"], 1),
                    "cpu_s": round(m["cpu_s"] - prev["cpu_s"], 1)})
        prev = m
    return out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (the flow checkpoints nothing more, workers exit),
    SIGKILL after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def write(out: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str) + "\n")
    tmp.replace(path)  # a reader never sees half a file


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-agentic.yaml")
    ap.add_argument("--iterations", type=int, default=None,
                    help="override the config's iterations (e.g. 2 for a smoke run)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides (repeatable)")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--resume", action="store_true",
                    help="continue --run-id from its last checkpoint")
    ap.add_argument("--timeout-s", type=float, default=4 * 3600)
    ap.add_argument("--out", default=str(ROOT / "results" / "agentic_multitask.json"))
    args = ap.parse_args()
    if args.resume and not args.run_id:
        ap.error("--resume needs --run-id (the run to continue)")
    os.chdir(ROOT)
    # Ctrl-C or a SIGTERM (a scheduler's, a `kill`) stop the run and still write the JSON:
    # both raise here (a shell that starts this in the background may have SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    run_id = args.run_id or time.strftime("agentic-multitask-%Y%m%d-%H%M%S")
    cmd = run_command(args, run_id)
    out_path = Path(args.out)
    try:  # a bad config fails here, before a run starts
        cfg = load_config(args.config, overrides(args))
    except ConfigError as err:
        write({"benchmark": "agentic_multitask", "status": "failed", "error": str(err),
               "command": shlex.join(cmd), "host": host_facts()}, out_path)
        print(f"agentic_multitask: failed; error: {err} -> {out_path}")
        return 2
    log_path = Path("artifacts") / f"{run_id}.log"
    store = RunStore.from_config(cfg.storage, run_id)
    out: dict[str, Any] = {
        "benchmark": "agentic_multitask", "status": "running", "error": None,
        "command": shlex.join(cmd), "config": args.config, "overrides": overrides(args),
        "benchmark_command": shlex.join(["python", "benchmarks/agentic_multitask.py",
                                         *sys.argv[1:]]),
        "run_id": run_id, "store": store.url, "log": str(log_path),
        "model": cfg.model.path, "engine": cfg.engine.backend,
        "iterations_planned": cfg.iterations,
        "batch": {"num_groups": cfg.rollout.num_groups, "group_size": cfg.rollout.group_size,
                  "eval_episodes": cfg.eval.episodes},
        "host": host_facts(),
    }
    write(out, out_path)
    t0 = time.perf_counter()
    rc: int | None = None
    marks: list[dict[str, float]] = []
    def progress(rows: list[dict[str, Any]]) -> None:
        """What the run has so far, on disk at once (the benchmark itself may be killed)."""
        out.update(summarise(cfg, rows), cpu_per_row=cpu_per_iteration(rows, marks),
                   wall_s=round(time.perf_counter() - t0, 1))
        write(out, out_path)

    try:
        rc = run_train(cmd, log_path, args.timeout_s, store, marks, progress)
        if rc is None:
            out["error"] = (f"rollart train ran past --timeout-s {args.timeout_s:.0f} and was "
                            f"stopped; continue it with --resume --run-id {run_id}")
        elif rc != 0:
            out["error"] = f"rollart train exited with {rc}"
    except BaseException as err:  # noqa: BLE001 - recorded in the JSON written below (Ctrl-C too)
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        out["returncode"] = rc
        out["host"]["loadavg_end"] = _read("/proc/loadavg")
        try:
            rows, torn = store.read_jsonl_torn("metrics.jsonl")
            out["metrics_torn_line_dropped"] = torn
            out.update(summarise(cfg, rows))
            # wall and CPU seconds per metrics row (the host's other load stretches the wall
            # time; the CPU seconds are the run's own work: with nproc cores free, an
            # iteration takes at least cpu_s / nproc)
            out["cpu_per_row"] = cpu_per_iteration(rows, marks)
        except Exception as err:  # noqa: BLE001 - the run's own error matters more
            out["error"] = out["error"] or f"reading metrics: {type(err).__name__}: {err}"
        if out["error"]:
            tail = _read(str(log_path)).splitlines()[-40:]
            out["log_tail"] = tail
            out["error"] += cause(tail)
        out["status"] = "ok" if not out["error"] else "failed"
        out["summary"] = one_line(out)
        write(out, out_path)
    print(out["summary"] + f" -> {out_path}")
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
