"""The rollout service's control path at scale: turns/s, per-turn overhead, scheduler decisions,
memory per live episode and CPU per 1,000 turns, for 64 .. 4,096 concurrent episodes, 1, 2 and 4
shards and 1 .. 32 engine replicas; and 6,144 and 8,192 on one shard (`headline.headroom`: the
p99 as its loop gets busier).

Engines and env hosts are emulated at zero cost (rollart/rollout/emulated.py: a timer per call,
no model, no env logic); everything else is the real code: `RolloutService` with
`rollout.runner: asyncio` (rollart/rollout/aio_runner.py), its `RolloutScheduler`, `TurnRouter`
(the affinity router prices every turn when there is more than one replica), batchers, env
manager, local reward handler, and `ShardedRollout` as the trainer's side. Each shard is its own
process (benchmarks/rollout_shard.py) whose event loop thread is pinned to core `k % cores`; the
thread that serves the trainer's side (taking a batch: milliseconds of CPU at thousands of
episodes) runs on the cores no shard's loop holds (every core when the loops hold them all), as
a Dask worker's threads would. One point at 8,192 episodes pins the whole shard process to the
loop's core instead (`"pin": "process"`, `headline.pin_process`): there a batch take runs on the
loop's core for milliseconds while the turns in flight wait (traced in a probe: 3-7 ms a take,
the loop woken up to 3.6 ms late, the largest cluster of the p99's turns). Two points, at 4,096
and 8,192 episodes, have the loop poll 200 us before each sleep (`rollout.idle_poll_us`,
`headline.idle_poll`): less latency for a core kept busy. The coordinator (a zero-cost trainer:
takes each batch as soon as every shard has its part, then `set_version(u + 1)`) runs in this
process.

Concurrency: group_size 4, max_staleness 7, num_groups = episodes / 32, so admission keeps at
most 8 batches = `episodes` episodes in flight (the measured mean is reported: completed groups
waiting for their batch are not live).

Two regimes:
- paced: engine call 0.25 s + 16 tokens x 0.02 s = 0.57 s, env reset/step 0.8 s (x [0.5, 1.5)):
  a turn is ~1.37 s of emulated time (~1.5 s with the reset spread over an episode's ~6 turns),
  so the ~3,400 episodes admission keeps live at a cap of 4,096 offer ~2,300 turns/s. Overhead per
  turn = measured turn latency (route -> batch -> engine -> env step -> bookkeeping) minus the
  nominal engine and env times (a late timer counts: it is the loop's lag);
- saturated: 2 ms engine calls and env steps: the offered load is far above what a core can do,
  so turns/s is the CPU's capacity; `two_shards_over_one` = saturated turns/s at 4,096, 2 shards
  over 1.

The shards run the asyncio runner on its default loop, the standard library's on select(2)
(`rollout.event_loop: select`, microsecond timers); one paced and one saturated point at 4,096
run uvloop for comparison (`headline.uvloop`). uvloop's timers count whole milliseconds, so
there the emulated engine's and env's waits themselves end up to ~1 ms off their nominal times,
which the overhead counts. After each of those two paced points at 4,096, the same waits run
with no service at all, as many pseudo-episodes as the point kept live
(benchmarks/rollout_floor.py): `headline.emulation_floor`, the overhead p99 a turn that cost the
loop nothing would show on that loop (and on this VM, where a sleeping vCPU wakes late, more than
that whenever the host is busy: see rollout_floor.py). New episodes start at `rollout.start_rate`
(2,000/s per shard, the default) in the paced regime; the saturated one raises it far above what
a core can run, so that its turns/s is the CPU's.

    .venv/bin/python benchmarks/rollout_scale.py --repeats 2   # -> results/rollout_scale.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_floor import floor_point  # noqa: E402
from rollout_shard import (  # noqa: E402
    ALPHA,
    GROUP,
    REGIMES,
    TOKENS,
    _host,
    _host_steal_s,
    shard_main,
)

from rollart.config import load_config  # noqa: E402
from rollart.envs import make_env  # noqa: E402
from rollart.models.chat import ChatFormat  # noqa: E402
from rollart.models.tokenizer import build_tokenizer  # noqa: E402
from rollart.rollout.shards import ShardedRollout  # noqa: E402

POLL_US = 200  # the idle_poll_us comparison points


class ShardProxy:
    """A shard process as a handle with RolloutService's methods (for ShardedRollout)."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self.samples: list[str] = []
        self.max_lag = 0

    def ask(self, cmd: str, arg: Any = None) -> Any:
        with self.lock:
            self.conn.send((cmd, arg))
            return self.conn.recv()

    def start(self) -> None:
        self.ask("start")

    def try_take(self, update: int) -> Any:
        out = self.ask("try_take", update)
        if out is None:
            return None
        ids, lag, dropped, metrics = out
        self.samples += ids
        self.max_lag = max(self.max_lag, lag)
        return [], {"dropped": dropped, "metrics": metrics}

    def set_version(self, version: int) -> None:
        self.ask("set_version", version)

    def stop(self) -> dict[str, Any]:
        return self.ask("stop")


def run_point(point: dict[str, Any], chat: ChatFormat, warmup: float, window: float
              ) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(point["shards"])]
    procs = [ctx.Process(target=shard_main, args=(c, point, k, chat), daemon=True)
             for k, (_, c) in enumerate(pipes)]
    for p in procs:
        p.start()
    proxies = [ShardProxy(mine) for mine, _ in pipes]
    for p in proxies:
        assert p.conn.recv() == "ready"
    coord = ShardedRollout(proxies)
    coord.start()
    stop, updates = threading.Event(), [0]

    def trainer() -> None:
        while not stop.is_set():
            if coord.try_take(updates[0]) is None:
                time.sleep(0.01)
                continue
            updates[0] += 1
            coord.set_version(updates[0])

    th = threading.Thread(target=trainer, daemon=True)
    th.start()
    time.sleep(warmup)
    for p in proxies:
        p.ask("mark")
    cpu0, u0, steal0 = time.process_time(), updates[0], _host_steal_s()
    time.sleep(window)
    for p in proxies:
        p.ask("mark")
    coord_cpu, batches = time.process_time() - cpu0, updates[0] - u0
    steal = _host_steal_s() - steal0
    reps = [p.ask("report") for p in proxies]
    stop.set()
    th.join()
    stats = coord.stop()
    for p in procs:
        p.join(timeout=10)
    samples = [s for p in proxies for s in p.samples]
    turns = sum(r["turns"] for r in reps)
    over = np.array([x for r in reps for x in r["overhead_s"]]) * 1e3
    sched = np.array([x for r in reps for x in r["sched_s"]]) * 1e3
    live = sum(r["live_mean"] for r in reps)
    return {**point,
            "turns_per_s": sum(r["turns"] / r["window_s"] for r in reps),
            "overhead_p50_ms": float(np.percentile(over, 50)) if len(over) else None,
            "overhead_p99_ms": float(np.percentile(over, 99)) if len(over) else None,
            "sched_decision_p50_ms": float(np.percentile(sched, 50)) if len(sched) else None,
            "sched_decision_p99_ms": float(np.percentile(sched, 99)) if len(sched) else None,
            "sched_p99_ms_by_call": [r["sched_p99_ms"] for r in reps],
            "sched_calls": [r["sched_calls"] for r in reps],
            "live_mean": live,
            "mem_per_live_episode_kb": sum(r["mem_bytes"] for r in reps) / 1024
            / max(1, sum(r["live_at_mark"] for r in reps)),
            "cpu_s_per_1000_turns": 1000 * sum(r["cpu_s"] for r in reps) / max(1, turns),
            "shard_cpu_util": [r["cpu_s"] / r["window_s"] for r in reps],
            # share of the window a shard's threads waited for a core held by someone else
            "shard_runqueue_wait_share": [r["runqueue_wait_s"] / r["window_s"] for r in reps],
            "coordinator_cpu_util": coord_cpu / window, "batches": batches,
            # share of the host's cores the hypervisor gave to other guests in the window (a
            # virtual machine's noisy neighbours: the p99 moves with it)
            "host_steal_share": steal / (window * (os.cpu_count() or 1)),
            "samples_consumed": len(samples), "samples_unique": len(set(samples)),
            "max_staleness_seen": max(p.max_lag for p in proxies),
            "counters": stats["counters"]}


def grid(quick: bool) -> list[dict[str, Any]]:
    pts = []
    for episodes in ((256, 4096) if quick else (64, 256, 1024, 4096)):
        for shards in (1, 2):
            pts.append({"regime": "paced", "episodes": episodes, "shards": shards,
                        "replicas": 8})
    if not quick:
        pts += [{"regime": "paced", "episodes": 4096, "shards": 1, "replicas": r}
                for r in (1, 32)]
        # the service tokenizing every observation itself (env hosts that send text only)
        pts.append({"regime": "paced", "episodes": 4096, "shards": 1, "replicas": 8,
                    "host_ids": False})
        # headroom: one shard past 4,096 (its loop busier), the p99 against the busy share
        pts += [{"regime": "paced", "episodes": e, "shards": 1, "replicas": 8}
                for e in (6144, 8192)]
        # the trainer's side on the loop's core (the whole shard process pinned to it)
        pts.append({"regime": "paced", "episodes": 8192, "shards": 1, "replicas": 8,
                    "pin": "process"})
        # the loop polling 200 us before each sleep (rollout.idle_poll_us)
        pts += [{"regime": "paced", "episodes": e, "shards": 1, "replicas": 8,
                 "idle_poll_us": POLL_US} for e in (4096, 8192)]
    # uvloop (rollout.event_loop: uvloop) against the default, the standard library's loop
    pts += [{"regime": r, "episodes": 4096, "shards": 1, "replicas": 8, "event_loop": "uvloop"}
            for r in ("paced", "saturated")]
    pts += [{"regime": "saturated", "episodes": 4096, "shards": s, "replicas": 8}
            for s in ((1, 2) if quick else (1, 2, 4))]
    return pts


def _with_floor(point: dict[str, Any]) -> bool:
    return (point["regime"] == "paced" and point["episodes"] == 4096 and point["shards"] == 1
            and point["replicas"] == 8 and point.get("host_ids", True)
            and "idle_poll_us" not in point)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=10.0, help="paced points (saturated: 4)")
    ap.add_argument("--window", type=float, default=6.0, help="paced points (saturated: 5)")
    ap.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "results/rollout_scale.json"))
    args = ap.parse_args()
    cfg = load_config(None, ["tasks=[{name: emu, env_id: FrozenLake-v1}]"])
    chat = ChatFormat(build_tokenizer(make_env(cfg.tasks[0]).corpus_texts(episodes=5), 320))
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for point in grid(args.quick):
            sat = point["regime"] == "saturated"
            r = run_point(point, chat, 4.0 if sat else args.warmup, 5.0 if sat else args.window)
            r["repeat"] = rep
            if _with_floor(point):  # the same waits with no service, at the same live count
                lat = REGIMES["paced"]
                r["emulation_floor"] = floor_point(
                    round(r["live_mean"]), lat["call_s"] + lat["token_s"] * TOKENS,
                    lat["step_s"], point.get("event_loop", cfg.rollout.event_loop),
                    window=args.window)  # the loop the point ran (the config's default)
                print(f"  emulation floor (no service): {r['emulation_floor']}", flush=True)
            runs.append(r)
            print(f"rep {rep} {point}: {r['turns_per_s']:.0f} turns/s, overhead p50/p99 "
                  f"{r['overhead_p50_ms']:.2f}/{r['overhead_p99_ms']:.2f} ms, live "
                  f"{r['live_mean']:.0f}, cpu/1k turns {r['cpu_s_per_1000_turns']:.3f} s, "
                  f"util {r['shard_cpu_util']}, runqueue wait {r['shard_runqueue_wait_share']}, "
                  f"host steal {r['host_steal_share']:.3f}", flush=True)
    out = summarise(runs, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    h = out["headline"]
    print(f"rollout_scale: turns_per_s_4096={h['turns_per_s_4096']:.0f} "
          f"overhead_p99_ms_4096={h['overhead_p99_ms_4096']:.2f} "
          f"two_shards_over_one={h['two_shards_over_one']:.2f} "
          f"(uvloop: overhead_p99_ms_4096={h['uvloop']['overhead_p99_ms_4096']:.2f}; "
          f"emulation floor p99 {h['emulation_floor']['overhead_p99_ms_4096']:.2f} select, "
          f"{h['emulation_floor']['uvloop_overhead_p99_ms_4096']:.2f} uvloop) "
          f"(spread over {args.repeats} repeats: {h['spread']})")


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def pick(**kw: Any) -> list[dict[str, Any]]:
        return [r for r in runs if all(r.get(k) == v for k, v in kw.items())]

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    def default(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rs if r.get("host_ids", True) and "event_loop" not in r
                and "pin" not in r and "idle_poll_us" not in r]

    paced = default(pick(regime="paced", episodes=4096, shards=1, replicas=8))
    whole = pick(regime="paced", episodes=8192, shards=1, replicas=8, pin="process")
    loop8k = default(pick(regime="paced", episodes=8192, shards=1, replicas=8))
    uv = pick(regime="paced", episodes=4096, shards=1, replicas=8, event_loop="uvloop")
    poll4k, poll8k = (pick(regime="paced", episodes=e, shards=1, replicas=8,
                           idle_poll_us=POLL_US) for e in (4096, 8192))
    sat1 = default(pick(regime="saturated", shards=1))
    sat_uv = pick(regime="saturated", shards=1, event_loop="uvloop")
    sat2 = pick(regime="saturated", shards=2)
    ratios = [b["turns_per_s"] / a["turns_per_s"] for a, b in zip(sat1, sat2, strict=True)]
    headline = {
        "turns_per_s_4096": med(paced, "turns_per_s"),
        "overhead_p99_ms_4096": med(paced, "overhead_p99_ms"),
        "overhead_p50_ms_4096": med(paced, "overhead_p50_ms"),
        "two_shards_over_one": statistics.median(ratios),
        "saturated_turns_per_s_1_shard": med(sat1, "turns_per_s"),
        "saturated_turns_per_s_2_shards": med(sat2, "turns_per_s"),
        # one shard past 4,096 episodes, every repeat: how the p99 grows with the loop's load
        "headroom": [{"episodes": r["episodes"], "turns_per_s": round(r["turns_per_s"]),
                      "shard_cpu_util": round(r["shard_cpu_util"][0], 3),
                      "overhead_p99_ms": round(r["overhead_p99_ms"], 2)}
                     for r in default(pick(regime="paced", shards=1, replicas=8))
                     if r["episodes"] > 4096],
        # 8,192 episodes with the trainer's side on the loop's core, against the default, per
        # repeat (empty in a --quick run)
        "pin_process": {
            "overhead_p99_ms_8192": [round(r["overhead_p99_ms"], 2) for r in whole],
            "default_overhead_p99_ms_8192": [round(r["overhead_p99_ms"], 2) for r in loop8k]},
        # the loop polling before it sleeps against the default, per repeat (empty in a
        # --quick run); its CPU per turn counts the polling
        "idle_poll": {
            "idle_poll_us": POLL_US,
            "overhead_p99_ms_4096": [round(r["overhead_p99_ms"], 2) for r in poll4k],
            "default_overhead_p99_ms_4096": [round(r["overhead_p99_ms"], 2) for r in paced],
            "overhead_p50_ms_4096": [round(r["overhead_p50_ms"], 2) for r in poll4k],
            "overhead_p99_ms_8192": [round(r["overhead_p99_ms"], 2) for r in poll8k],
            "default_overhead_p99_ms_8192": [round(r["overhead_p99_ms"], 2) for r in loop8k],
            "shard_cpu_util_4096": [round(r["shard_cpu_util"][0], 3) for r in poll4k],
            "cpu_per_turn_over_default_4096": [
                round(b["cpu_s_per_1000_turns"] / a["cpu_s_per_1000_turns"], 3)
                for a, b in zip(paced, poll4k, strict=False)]},
        # uvloop against the default (the standard library's loop), per repeat, back to back
        "uvloop": {
            "overhead_p99_ms_4096": med(uv, "overhead_p99_ms"),
            "overhead_p50_ms_4096": med(uv, "overhead_p50_ms"),
            "cpu_per_turn_over_select": statistics.median(
                b["cpu_s_per_1000_turns"] / a["cpu_s_per_1000_turns"]
                for a, b in zip(paced, uv, strict=True)),
            "saturated_over_select": statistics.median(
                b["turns_per_s"] / a["turns_per_s"] for a, b in zip(sat1, sat_uv, strict=True)),
        },
        # the same waits on the same loop with no service, as many live
        # (benchmarks/rollout_floor.py): the loop's timers and the host's wake-ups
        "emulation_floor": {
            "overhead_p99_ms_4096": med([r["emulation_floor"] for r in paced], "overhead_p99_ms"),
            "uvloop_overhead_p99_ms_4096": med([r["emulation_floor"] for r in uv],
                                               "overhead_p99_ms")},
        "spread": {"turns_per_s_4096": [round(r["turns_per_s"]) for r in paced],
                   # the shard's CPU per turn: how fast this host runs the service's code
                   "cpu_ms_per_turn_4096": [round(r["cpu_s_per_1000_turns"], 3) for r in paced],
                   "overhead_p99_ms_4096": [round(r["overhead_p99_ms"], 2) for r in paced],
                   "emulation_floor_p99_ms_4096": [
                       round(r["emulation_floor"]["overhead_p99_ms"], 2) for r in paced],
                   "host_steal_share_4096": [round(r["host_steal_share"], 3) for r in paced],
                   "uvloop_overhead_p99_ms_4096": [round(r["overhead_p99_ms"], 2) for r in uv],
                   "uvloop_emulation_floor_p99_ms_4096": [
                       round(r["emulation_floor"]["overhead_p99_ms"], 2) for r in uv],
                   "uvloop_cpu_per_turn_over_select": [
                       round(b["cpu_s_per_1000_turns"] / a["cpu_s_per_1000_turns"], 3)
                       for a, b in zip(paced, uv, strict=True)],
                   "saturated_uvloop_over_select": [
                       round(b["turns_per_s"] / a["turns_per_s"], 3)
                       for a, b in zip(sat1, sat_uv, strict=True)],
                   "two_shards_over_one": [round(x, 3) for x in ratios]},
    }
    return {"headline": headline, "runs": runs,
            "setup": {"group_size": GROUP, "max_staleness": ALPHA, "tokens_per_turn": TOKENS,
                      "regimes": REGIMES, "warmup_s": args.warmup, "window_s": args.window,
                      "repeats": args.repeats, "cores": os.cpu_count(),
                      "load_avg_at_end": os.getloadavg(), "host": _host()}}


if __name__ == "__main__":
    main()
