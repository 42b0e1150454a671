"""One shard process of benchmarks/rollout_scale.py: the real RolloutService on emulated engines
and env hosts, serving the coordinator's calls over a pipe and measuring between two marks
(turn overheads, scheduler and routing calls, CPU, memory, run-queue waits); and the host's
identity and counters the benchmark records."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollart.config import load_config
from rollart.models.chat import ChatFormat
from rollart.rewards.client import LocalRewardClient
from rollart.rollout.emulated import EmulatedEngine, EmulatedEnvHost
from rollart.rollout.service import RolloutService
from rollart.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GROUP, ALPHA, TOKENS = 4, 7, 16
REGIMES = {"paced": {"call_s": 0.25, "token_s": 0.02, "step_s": 0.8, "start_rate": 2000.0},
           "saturated": {"call_s": 0.002, "token_s": 0.0, "step_s": 0.002,
                         "start_rate": 50_000.0}}
SCHED = ("fill", "on_finished", "on_failed", "on_version", "take_batch")
ANSWER = "<answer>right</answer>"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_steal_s() -> float:
    """CPU seconds the hypervisor gave to other guests, all cores (/proc/stat `steal`)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def _host() -> dict[str, Any]:
    """Which machine and code measured this: a re-run counts as a reproduction only on another
    machine (another boot id: these VMs mask their CPU model) of the same commit."""
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""
    model = [ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines()
             if ln.startswith("model name")]
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"boot_id": read("/proc/sys/kernel/random/boot_id").strip(),
            "cpu_model": model[0] if model else "", "commit": commit}


def _runqueue_wait_s() -> float:
    """Seconds this process's threads were runnable but waiting for a CPU (other processes on
    the core): /proc/self/task/*/schedstat, second field."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def _timed(obj: Any, name: str, log: list[tuple[str, float, float]]) -> None:
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((name, t0, time.perf_counter() - t0))

    setattr(obj, name, wrapper)


def build(point: dict[str, Any], shard: int, chat: ChatFormat
          ) -> tuple[RolloutService, list[EmulatedEngine], EmulatedEnvHost]:
    lat = REGIMES[point["regime"]]
    cfg = load_config(None, [
        "tasks=[{name: emu, env_id: FrozenLake-v1, max_turns: 8}]",
        f"rollout.num_groups={point['episodes'] // (GROUP * (ALPHA + 1))}",
        f"rollout.group_size={GROUP}", f"rollout.max_staleness={ALPHA}",
        "rollout.runner=asyncio", "rollout.batching=continuous", "rollout.batch_wait_s=0",
        "rollout.max_consecutive_failures=0", f"engine.replicas={point['replicas']}",
        "iterations=100000", f"rollout.start_rate={lat['start_rate']}",
        *([f"rollout.event_loop={point['event_loop']}"] if "event_loop" in point else []),
        *([f"rollout.idle_poll_us={point['idle_poll_us']}"] if "idle_poll_us" in point else [])])
    ids = chat.encode(ANSWER)[:1] * TOKENS
    engines = [EmulatedEngine(lat["call_s"], lat["token_s"], ids, ANSWER)
               for _ in range(point["replicas"])]
    host = EmulatedEnvHost(lat["step_s"], chat=chat if point.get("host_ids", True) else None)
    svc = RolloutService(cfg, chat, engines, [host], LocalRewardClient(),
                         {"emu": SamplingParams(max_new_tokens=TOKENS)}, max_context=4096,
                         shard=(shard, point["shards"]))
    return svc, engines, host


def trainer_cores(shards: int) -> set[int]:
    """Where a shard's calls from the trainer's side run: the cores no shard's loop holds, or
    every core when the loops hold them all."""
    n = os.cpu_count() or 1
    return set(range(n)) - {k % n for k in range(shards)} or set(range(n))


def shard_main(conn: Any, point: dict[str, Any], shard: int, chat: ChatFormat) -> None:
    """One shard process: serves the coordinator's calls, measures between two marks."""
    os.sched_setaffinity(0, {shard % os.cpu_count()})  # the loop thread, started below, too
    svc, engines, host = build(point, shard, chat)
    log: list[tuple[str, float, float]] = []
    for name in SCHED:
        _timed(svc.sched, name, log)
    _timed(svc.routing, "route", log)
    rss0, marks, live = _rss(), [], []
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        out: Any = None
        if cmd == "start":
            svc.start()
            if point.get("pin", "loop") == "loop":  # this thread (the trainer's side) only
                os.sched_setaffinity(0, trainer_cores(point["shards"]))
        elif cmd == "try_take":
            if len(marks) == 1:
                live.append(len(svc.live))
            got = svc.try_take(arg)
            if got is not None:
                trajs, info = got
                lag = max(arg - t.turns[0].weight_version for t in trajs)  # its start version
                out = ([t.sample_id for t in trajs], lag, info["dropped"],
                       {k: v for k, v in info["metrics"].items() if k.startswith("rollout/")})
                del trajs, got  # as a trainer would once sent: the service frees them (release)
        elif cmd == "set_version":
            for e in engines:
                e.weight_version = arg
            svc.set_version(arg)
        elif cmd == "mark":
            if not marks:
                svc.runner.turn_log = []
                del log[:]
            marks.append((time.perf_counter(), time.process_time(), _rss(), len(svc.live),
                          _runqueue_wait_s()))
        elif cmd == "report":
            out = _report(svc, engines[0].nominal_s, host, marks, log, live, rss0)
        elif cmd == "stop":
            out = svc.stop()
            conn.send(out)
            return
        conn.send(out)


def _report(svc: RolloutService, engine_s: float, host: EmulatedEnvHost, marks: list,
            log: list, live: list[int], rss0: int) -> dict[str, Any]:
    (a, cpu_a, rss_a, live_a, wait_a), (b, cpu_b, _, _, wait_b) = marks[0], marks[1]
    turns = [x for x in svc.runner.turn_log if a <= x[1] <= b]
    overhead = [(t1 - t0) - engine_s - host.nominal_s(eid, turn) for t0, t1, eid, turn in turns]
    sched = [dt for name, t0, dt in log if name != "route" and a <= t0 <= b]
    by = {n: [dt for name, t0, dt in log if name == n and a <= t0 <= b] for n in (*SCHED, "route")}
    return {"window_s": b - a, "turns": len(turns), "cpu_s": cpu_b - cpu_a,
            "runqueue_wait_s": wait_b - wait_a,
            "overhead_s": overhead, "sched_s": sched,
            "sched_p99_ms": {n: float(np.percentile(v, 99) * 1e3) for n, v in by.items() if v},
            "sched_calls": {n: len(v) for n, v in by.items()},
            "mem_bytes": rss_a - rss0, "live_at_mark": live_a,
            "live_mean": statistics.fmean(live) if live else float(live_a)}
