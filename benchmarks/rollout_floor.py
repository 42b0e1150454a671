"""rollout_scale.py's per-turn overhead with no service: the emulated waits alone.

rollout_scale subtracts the emulated engine's and env's nominal times from each turn's latency;
their waits are the loop's own timers (rollart/rollout/emulated.py), and uvloop's count whole
milliseconds of a clock read once per loop iteration, so each wait ends up to ~1 ms off its
nominal time whatever the service does. This runs the same waits with no service at all: `live`
pseudo-episodes on one loop (one process, pinned to core 0 like shard 0), each a reset wait and
then turns of an engine wait and an env step wait with the paced regime's nominal times (the same
per-episode jitter), and reports latency minus nominal per turn: what the loop's timers and the
host's wake-ups give a turn that costs nothing. Not a lower bound for the service's figures on
a virtual machine: this loop sleeps most of the time (~17 % busy on uvloop), and a sleeping
vCPU wakes late when the host has given its core away (the service's busier loop sleeps less).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import random
import time
from functools import partial
from typing import Any

import numpy as np

from rollart.rollout.aio_runner import new_loop
from rollart.rollout.emulated import EmulatedEnvHost, WaitClock


async def _episodes(k: int, engine_s: float, host: EmulatedEnvHost, spread_s: float,
                    warm_until: float, stop_at: float, out: list[float]) -> None:
    sleep = partial(WaitClock.sleep, host)  # the emulated hosts' own waits, nothing else
    await sleep(random.Random(k).uniform(0.0, spread_s))  # not in lockstep
    gen = 0
    while True:
        eid = f"floor{k}-{gen}"
        await sleep(host.nominal_s(eid, -1))  # the reset
        for turn in range(host.turns(k + gen)):
            step_s = host.nominal_s(eid, turn)
            t0 = time.perf_counter()
            await sleep(engine_s)
            await sleep(step_s)
            t1 = time.perf_counter()
            if t1 > stop_at:
                return
            if t0 >= warm_until:
                out.append(t1 - t0 - engine_s - step_s)
        gen += 1


def _floor_main(conn: Any, live: int, engine_s: float, step_s: float, event_loop: str,
                warmup: float, window: float) -> None:
    os.sched_setaffinity(0, {0})
    gc.freeze()  # as the asyncio runner (rollout.gc_every_s): no collection inside the window
    gc.disable()
    host, out = EmulatedEnvHost(step_s), []
    loop = new_loop(event_loop)
    t = time.perf_counter()
    spread = engine_s + 1.5 * step_s  # about one turn
    cpu0 = time.process_time()

    async def run() -> None:
        await asyncio.gather(*(
            _episodes(k, engine_s, host, spread, t + warmup, t + warmup + window, out)
            for k in range(live)))

    loop.run_until_complete(run())
    loop.close()
    conn.send((out, time.process_time() - cpu0))


def floor_point(live: int, engine_s: float, step_s: float, event_loop: str,
                warmup: float = 4.0, window: float = 6.0) -> dict[str, Any]:
    """Overhead percentiles (ms) of `live` pseudo-episodes whose turns cost nothing."""
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_floor_main, daemon=True,
                    args=(theirs, live, engine_s, step_s, event_loop, warmup, window))
    p.start()
    over, cpu_s = mine.recv()
    p.join(timeout=10)
    ms = np.array(over) * 1e3
    return {"live": live, "event_loop": event_loop, "turns": len(ms),
            "turns_per_s": len(ms) / window, "cpu_util": cpu_s / (warmup + window),
            "overhead_p50_ms": float(np.percentile(ms, 50)),
            "overhead_p99_ms": float(np.percentile(ms, 99))}
