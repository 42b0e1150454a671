"""Zero-cost emulated engines and env hosts, to measure the rollout service's control path alone.

`EmulatedEngine.generate` and `EmulatedEnvHost.open/step/close` are coroutines: the asyncio
runner (rollart/rollout/aio_runner.py) awaits them on its loop, so an emulated turn costs only
its timer, and everything else a turn does is the real service's code (scheduler, router,
batchers, env manager, token bookkeeping, reward, ledger). No model, no env logic:

- engine: every call takes `call_s + token_s * tokens` seconds (fixed per-call latency plus a
  per-token cost) and answers each request with `tokens` tokens; it accepts any number of calls
  at once (`concurrent_calls`), like a continuous-batching server, so a turn never queues
  behind another batch;
- env host: a reset or step takes `step_s(episode id, turn)` seconds: `step_s` times a
  deterministic factor in [0.5, 1.5) (so episodes do not stay in lockstep waves), and an
  episode ends after `turns(seed)` steps.

Benchmarks subtract these nominal times from the measured turn latency: what is left (loop
lag included, since a late timer is the loop's fault) is the control overhead.
"""

from __future__ import annotations

import asyncio
import heapq
import zlib
from collections.abc import Awaitable
from typing import Any

from rollart.models.chat import ChatFormat
from rollart.types import Completion, GenerationRequest

OBSERVATION = "You stand on tile {pos} of 16. Goal: tile 15. Moves so far: {turn}."


def jitter(key: str) -> float:
    """A deterministic factor in [0.5, 1.5) from `key` (the same in every process)."""
    return 0.5 + (zlib.crc32(key.encode()) % 10_000) / 10_000


class WaitClock:
    """An emulated host's waits: what each costs the loop should be what a remote reply
    would, not more. uvloop's timers are C (`asyncio.sleep` as is); on the standard library's
    loop every wait would be a Python TimerHandle in the loop's heap, ordered by Python-level
    comparisons (~28 per turn with thousands of waits in flight: ~8 % of its busy time). Here
    the waits of one loop are kept by us behind a single loop timer at the earliest deadline
    (the loop's clock, so as exact as its timers): a heap of bare deadlines (float comparisons;
    (deadline, seq, future) tuples cost ~2 us a pop at 8,192 waits) and each deadline's waits
    in the order they were made."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[float] = []  # the deadlines, each once
        self.due: dict[float, list[asyncio.Future]] = {}  # deadline -> its waits, in order
        self.armed = float("inf")  # the deadline the loop timer is set for
        self.timer: asyncio.TimerHandle | None = None

    @staticmethod
    def sleep(owner: Any, delay: float) -> Awaitable[None]:
        """`asyncio.sleep(delay)` for `owner` (an emulated engine or host, which keeps its
        clock in `owner._clock`). Not a coroutine itself: the caller awaits the wait directly,
        one frame less to pass through on every suspend and resume."""
        loop = asyncio.get_running_loop()
        if not isinstance(loop, asyncio.BaseEventLoop):  # uvloop: its own timers are C
            return asyncio.sleep(delay)
        clock = owner._clock
        if clock is None or clock.loop is not loop:
            clock = owner._clock = WaitClock(loop)
        return clock.wait(delay)

    def wait(self, delay: float) -> asyncio.Future:
        fut = self.loop.create_future()
        when = self.loop.time() + delay
        waits = self.due.get(when)
        if waits is not None:  # a tie: ends right after the earlier ones
            waits.append(fut)
            return fut
        self.due[when] = [fut]
        heapq.heappush(self.heap, when)
        if when < self.armed:
            self._arm(when)
        return fut

    def _arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.armed = self.loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self.timer, self.armed = None, float("inf")
        heap, due, now = self.heap, self.due, self.loop.time()
        while heap and heap[0] <= now:
            for fut in due.pop(heapq.heappop(heap)):
                if not fut.done():  # cancelled meanwhile
                    fut.set_result(None)
        if heap:
            self._arm(heap[0])


class EmulatedEngine:
    """An inference engine that only waits: `call_s + token_s * tokens` per call."""

    concurrent_calls = 1 << 20

    def __init__(self, call_s: float, token_s: float, tokens: list[int], text: str,
                 params: float = 135e6) -> None:
        self.call_s, self.token_s, self.tokens, self.text = call_s, token_s, tokens, text
        self.params = params
        self._clock: WaitClock | None = None
        self.weight_version = 0
        self.calls = 0
        self.requests = 0

    @property
    def nominal_s(self) -> float:
        return self.call_s + self.token_s * len(self.tokens)

    def param_count(self) -> float:
        return self.params

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        version, wait = self.weight_version, self.nominal_s
        await WaitClock.sleep(self, wait)
        self.calls += 1
        self.requests += len(requests)
        n = len(self.tokens)
        return [Completion(r.request_id, list(self.tokens), [-0.5] * n, self.text, "eos",
                           version, len(r.prompt_ids), wait) for r in requests]


class EmulatedEnvHost:
    """An env host whose envs only wait; episode `e` (seed s) ends after `turns(s)` steps."""

    SYSTEM = "Reach the goal. Answer with <answer>MOVE</answer>."

    def __init__(self, step_s: float, min_turns: int = 4, max_turns: int = 8,
                 chat: ChatFormat | None = None) -> None:
        """`chat`: answer with prompt ids too, as an env host that tokenizes its observations
        would (computed once per distinct text here: the emulated host costs nothing)."""
        self.step_s, self.min_turns, self.max_turns = step_s, min_turns, max_turns
        self.envs: dict[str, list[int]] = {}  # episode id -> [turn, turns]
        self.opened = 0
        self.chat = chat
        self._clock: WaitClock | None = None
        self._ids: dict[tuple[bool, str], list[int]] = {}

    def _prompt_ids(self, first: bool, obs: str) -> list[int]:
        ids = self._ids.get((first, obs))
        if ids is None:
            c = self.chat
            ids = c.first_prompt(self.SYSTEM, obs) if first else c.next_prompt(obs)
            self._ids[(first, obs)] = ids
        return list(ids)

    def turns(self, seed: int) -> int:
        return self.min_turns + seed % (self.max_turns - self.min_turns + 1)

    def nominal_s(self, episode_id: str, turn: int) -> float:
        """The wait of step `turn` of the episode (turn -1: the reset)."""
        return self.step_s * jitter(f"{episode_id}#{turn}")

    async def open(self, episode_id: str, task: str, seed: int) -> tuple:
        await WaitClock.sleep(self, self.nominal_s(episode_id, -1))
        self.envs[episode_id] = [0, self.turns(seed)]
        self.opened += 1
        obs = OBSERVATION.format(pos=seed % 16, turn=0)
        if self.chat is None:
            return self.SYSTEM, obs
        return self.SYSTEM, obs, self._prompt_ids(True, obs)

    async def step(self, episode_id: str, text: str) -> tuple[str, float, bool, bool, dict]:
        state = self.envs[episode_id]
        await WaitClock.sleep(self, self.nominal_s(episode_id, state[0]))
        state[0] += 1
        done = state[0] >= state[1]
        obs = OBSERVATION.format(pos=state[0], turn=state[0])
        info: dict[str, Any] = {"action": "right", "format_ok": True, "success": done}
        if self.chat is not None and not done:
            info["prompt_ids"] = self._prompt_ids(False, obs)
        return obs, 1.0 if done else 0.0, done, False, info

    async def close(self, episode_id: str) -> None:
        self.envs.pop(episode_id, None)

    async def stats(self) -> dict[str, Any]:
        return {"live_envs": len(self.envs), "opened": self.opened}
