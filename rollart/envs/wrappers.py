"""Env wrappers that inject latency and faults, configured per task (`latency:`, `faults:`).

`LatencyEnv` stands for slow tools or sandboxes: a heavy-tailed step latency, so benchmarks can
show what asynchrony buys when a few episodes straggle. `FaultEnv` is chaos testing: steps that
raise, and one step that hangs, so tests can check that a failure costs one episode only.

Injected faults are counted per worker process in `INJECTED` (task name -> kind -> count), which
env hosts report, so a test can compare what the rollout service counted with what happened.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from rollart.config import FaultConfig, LatencyConfig
from rollart.envs.base import Env


class InjectedFault(RuntimeError):
    """Raised by FaultEnv: an injected env error, not a bug."""


INJECTED: defaultdict[str, Counter[str]] = defaultdict(Counter)
_STEPS: Counter[str] = Counter()  # steps per task in this process (for hang_at_step)
_LOCK = threading.Lock()


class _Wrapper:
    def __init__(self, env: Env) -> None:
        self.env = env

    @property
    def system_prompt(self) -> str:
        return self.env.system_prompt

    @property
    def action_names(self) -> list[str]:
        return self.env.action_names

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed=seed)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self.env.step(action_text)

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:  # corpus_texts, render, ... of the inner env
        return getattr(self.env, name)


class LatencyEnv(_Wrapper):
    def __init__(self, env: Env, cfg: LatencyConfig) -> None:
        super().__init__(env)
        self.cfg = cfg
        self.rng = random.Random()

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.rng.seed(f"latency/{seed}/{id(self)}")
        return self.env.reset(seed=seed)

    def delay(self) -> float:
        return self.cfg.sample(self.rng)  # shared with the simulator (rollart/sim)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        time.sleep(self.delay())
        return self.env.step(action_text)


class FaultEnv(_Wrapper):
    def __init__(self, env: Env, cfg: FaultConfig, task: str) -> None:
        super().__init__(env)
        self.cfg, self.task = cfg, task
        self.rng = random.Random()

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.rng.seed(f"faults/{self.task}/{seed}/{id(self)}")
        return self.env.reset(seed=seed)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with _LOCK:
            _STEPS[self.task] += 1
            hang = _STEPS[self.task] == self.cfg.hang_at_step
            error = not hang and self.rng.random() < self.cfg.step_error_rate
            if hang or error:
                INJECTED[self.task]["hangs" if hang else "errors"] += 1
        if hang:
            time.sleep(self.cfg.hang_s)
        if error:
            raise InjectedFault(f"injected env step error ({self.task})")
        return self.env.step(action_text)


def injected_counts() -> dict[str, dict[str, int]]:
    with _LOCK:
        return {task: dict(c) for task, c in INJECTED.items()}
