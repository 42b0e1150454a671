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


def test_waits_with_the_same_deadline_end_in_the_order_they_were_made():
    """The tie path: waits whose deadlines are the same float share one heap entry (the loop's
    clock is held still here while they are made, so waits of one delay tie). Each ends, in
    the order it was made, a cancelled one is skipped, and a later deadline still ends after
    them."""
    owner, order = Owner(), []

    async def one(name: str, delay: float) -> None:
        await WaitClock.sleep(owner, delay)
        order.append(name)

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        real, held = loop.time, [loop.time()]
        loop.time = lambda: held[0] if held else real()  # type: ignore[method-assign]
        names = ["a", "b", "gone", "c"]
        tasks = {n: asyncio.ensure_future(one(n, 0.020)) for n in names}
        tasks["later"] = asyncio.ensure_future(one("later", 0.030))
        tasks["first"] = asyncio.ensure_future(one("first", 0.005))
        await asyncio.sleep(0)  # every wait made, at one clock reading
        held.clear()  # the clock runs again
        clock = owner._clock
        tied = max(len(waits) for waits in clock.due.values())
        deadlines = len(clock.heap)
        tasks["gone"].cancel()
        # a wait lost from its deadline would never end: fail instead of hanging
        await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 10.0)
        return tied, deadlines

    tied, deadlines = _run(main())
    assert (tied, deadlines) == (4, 3)  # the four 20 ms waits under one deadline
    assert order == ["first", "a", "b", "c", "later"]
