"""Env hosts: where environments live while the rollout service runs their episodes.

`EnvHost` holds the live envs of one process (open / step / close by episode id). In a Dask run
each CPU-class worker holds one `EnvHostService` actor around it. Its methods are coroutines, so
they run on the worker's event loop and hand the env call to the host's own thread pool: many
episodes step at once, and an env that hangs ties up one pool thread, never the worker (Dask
runs a worker's ordinary actor methods on a single thread). The rollout service enforces the
per-call timeout (`rollout.env_timeout_s`) on its side, so the same rule holds for in-process
hosts and for a host whose worker died.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollart.config import TaskConfig
from rollart.envs import make_env
from rollart.envs.wrappers import injected_counts
from rollart.handles import call, worker_identity
from rollart.models.chat import ChatFormat
from rollart.run import RunSpec

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


class EnvHost:
    """The envs of one process, keyed by episode id. Thread-safe; each env is used by one
    episode at a time. With the run's chat format (`chat`), the host also tokenizes what its
    envs say, so the rollout service (one process for every episode) does not: `open` adds the
    prompt ids of system + observation + assistant header, `step` adds those of the next
    observation as info["prompt_ids"] (rollart/rollout/env_manager.py uses them as given)."""

    def __init__(self, tasks: list[TaskConfig], chat: ChatFormat | None = None) -> None:
        self.tasks = {t.name: t for t in tasks}
        self.envs: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.opened = 0
        self.chat = chat

    def open(self, episode_id: str, task: str, seed: int) -> tuple:
        """Build and reset the env; returns (system prompt, first observation[, prompt ids])."""
        env = make_env(self.tasks[task])
        with self.lock:
            self.envs[episode_id] = env
            self.opened += 1
        obs, _ = env.reset(seed=seed)
        if self.chat is None:
            return env.system_prompt, obs
        return env.system_prompt, obs, self.chat.first_prompt(env.system_prompt, obs)

    def step(self, episode_id: str, text: str) -> StepResult:
        with self.lock:
            env = self.envs[episode_id]
        obs, reward, terminated, truncated, info = env.step(text)
        if self.chat is not None and not (terminated or truncated):
            info = {**info, "prompt_ids": self.chat.next_prompt(obs)}
        return obs, reward, terminated, truncated, info

    def close(self, episode_id: str) -> None:
        with self.lock:
            env = self.envs.pop(episode_id, None)
        if env is not None:
            try:
                env.close()
            except Exception:  # closing a broken env must not cost anything more
                pass

    def stats(self) -> dict[str, Any]:
        with self.lock:
            live = len(self.envs)
        return {"live_envs": live, "opened": self.opened, "injected": injected_counts()}


class EnvHostService:
    """Dask actor: an EnvHost on a CPU-class worker (async methods, own thread pool)."""

    def __init__(self, run: RunSpec) -> None:
        from rollart.models.run_model import chat_format  # the run's tokenizer (prepared)

        self.host = EnvHost(run.cfg.tasks, chat_format(run))
        self.pool = ThreadPoolExecutor(run.cfg.rollout.env_host_threads, thread_name_prefix="env")

    async def _run(self, fn, *args):  # noqa: ANN001, ANN202
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def open(self, episode_id: str, task: str, seed: int) -> tuple:
        return await self._run(self.host.open, episode_id, task, seed)

    async def step(self, episode_id: str, text: str) -> StepResult:
        return await self._run(self.host.step, episode_id, text)

    async def close(self, episode_id: str) -> None:
        return await self._run(self.host.close, episode_id)

    async def stats(self) -> dict[str, Any]:
        return {**self.host.stats(), **worker_identity()}


class HostedEnv:
    """The Env interface over an env host handle, for one episode of the rollout service `svc`
    (duck-typed: `cfg`, `hosts`, `hosts_alive`, `host_lost`); arms its watchdog around every
    env call (`live.deadline`)."""

    def __init__(self, svc: Any, live: Any) -> None:
        self.svc, self.live = svc, live
        self.system_prompt = ""

    def _call(self, method: str, *args: Any) -> Any:
        self.live.deadline = time.monotonic() + self.svc.cfg.rollout.env_timeout_s
        try:
            return call(self.svc.hosts[self.live.host], method, *args)
        except OSError:  # the host's worker is gone: route new episodes around it
            self.svc.host_lost(self.live.host)
            raise
        finally:
            self.live.deadline = None

    def reset(self, seed: int) -> tuple[str, dict]:
        opened = self._call("open", self.live.id, self.live.start.task, seed)
        self.system_prompt, obs = opened[0], opened[1]
        return obs, {"prompt_ids": opened[2]} if len(opened) > 2 else {}

    def step(self, text: str) -> tuple[str, float, bool, bool, dict]:
        return self._call("step", self.live.id, text)

    def close(self) -> None:
        if self.svc.hosts_alive[self.live.host]:
            try:
                call(self.svc.hosts[self.live.host], "close", self.live.id)
            except Exception:  # best effort: the episode is over either way
                pass
