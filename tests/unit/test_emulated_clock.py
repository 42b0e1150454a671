"""The emulated hosts' waits on the standard library's loop (rollart/rollout/emulated.py)."""

import asyncio
import selectors
import time

from rollart.rollout.emulated import WaitClock


class Owner:
    _clock = None


def _run(coro):
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_waits_end_in_deadline_order_never_early_behind_one_loop_timer():
    owner, ends = Owner(), []

    async def one(k: int, delay: float) -> None:
        t0 = time.monotonic()
        await WaitClock.sleep(owner, delay)
        ends.append((k, time.monotonic() - t0 - delay))

    async def main() -> int:
        delays = [0.030, 0.010, 0.020, 0.010, 0.040, 0.001]
        tasks = [asyncio.ensure_future(one(k, d)) for k, d in enumerate(delays)]
        await asyncio.sleep(0)  # every wait registered
        # the loop's own heap holds one timer for all six waits (and none of asyncio.sleep's)
        timers = [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]
        await asyncio.gather(*tasks)
        return len(timers)

    assert _run(main()) == 1
    assert [k for k, _ in ends] == [5, 1, 3, 2, 0, 4]  # ties: in the order they were made
    assert all(late >= 0 for _, late in ends), ends  # the select loop's clock: exact
    assert all(late < 0.5 for _, late in ends), ends  # (a generous bound: a loaded CI host)


def test_a_cancelled_wait_is_skipped_and_the_others_still_end():
    owner = Owner()

    async def main() -> list[str]:
        done: list[str] = []

        async def one(name: str, delay: float) -> None:
            await WaitClock.sleep(owner, delay)
            done.append(name)

        a = asyncio.ensure_future(one("a", 0.005))
        b = asyncio.ensure_future(one("b", 0.010))
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        return done

    assert _run(main()) == ["b"]


def test_on_uvloop_a_wait_is_asyncio_sleep():
    import uvloop

    owner = Owner()

    async def main() -> None:
        await WaitClock.sleep(owner, 0.002)

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert owner._clock is None  # uvloop's timers are C: no clock of ours
