"""The asyncio runner's loop polling before it sleeps (`rollout.idle_poll_us`)."""

import asyncio
import threading
import time

import pytest
from pydantic import ValidationError

from rollart.config import RolloutConfig
from rollart.rollout.aio_runner import PollingSelector, new_loop


def test_a_wait_longer_than_the_poll_sleeps_for_the_rest():
    sel = PollingSelector(0.002)
    try:
        w0, c0 = time.perf_counter(), time.thread_time()
        assert sel.select(0.3) == []  # nothing registered: only the timeout ends it
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    finally:
        sel.close()
    assert wall >= 0.3
    # polled 2 ms, slept the rest: a loop that polled the whole wait would spend ~0.3 s
    assert cpu < 0.15, cpu


def test_a_wait_shorter_than_the_poll_ends_at_its_timeout_without_sleeping():
    sel = PollingSelector(1.0)
    try:
        w0 = time.perf_counter()
        assert sel.select(0.01) == []
        wall = time.perf_counter() - w0
    finally:
        sel.close()
    assert 0.01 <= wall < 0.5  # the bound: a loaded CI host


def test_the_loop_polling_still_runs_timers_and_calls_from_other_threads():
    loop = new_loop("select", 0.001)
    assert isinstance(loop._selector, PollingSelector)
    got: list[str] = []

    async def main() -> None:
        done = asyncio.Event()
        t0 = loop.time()
        await asyncio.sleep(0.02)
        got.append("timer" if loop.time() - t0 >= 0.02 else "early")
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(
            lambda: (got.append("thread"), done.set()))).start()
        await asyncio.wait_for(done.wait(), timeout=10)  # woken through the self-pipe

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == ["timer", "thread"]


def test_polling_needs_the_select_loop():
    assert RolloutConfig(runner="asyncio", idle_poll_us=200).idle_poll_us == 200
    with pytest.raises(ValidationError, match="needs rollout.event_loop=select"):
        RolloutConfig(runner="asyncio", event_loop="uvloop", idle_poll_us=200)
    with pytest.raises(ValidationError):
        RolloutConfig(idle_poll_us=-1)
