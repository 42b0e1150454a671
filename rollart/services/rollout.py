"""`RolloutServiceActor`: the run's RolloutService on an env-class worker, as a Dask actor."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollart.handles import worker_identity
from rollart.rollout.env_host import EnvHostService
from rollart.rollout.service_failures import RolloutBroken
from rollart.rollout.setup import build_rollout_service
from rollart.run import RunSpec
from rollart.services.engine import EngineService
from rollart.types import Trajectory


class RolloutServiceActor:
    """Its threads call the engine and env-host actors; `take_batch` is a coroutine (it polls on
    the worker's event loop), so waiting for a batch never holds the worker's single actor
    thread."""

    BROKEN_POLL_S = 0.5

    def __init__(self, run: RunSpec, engine_refs: list[tuple[str, str]],
                 host_refs: list[tuple[str, str]], version: int = 0,
                 shard: tuple[int, int] = (0, 1)) -> None:
        from distributed.actor import Actor

        # Engines and env hosts by (actor key, worker address): handles, not graph
        # dependencies, so a lost engine or env worker does not take this actor down with it.
        hosts = [Actor(EnvHostService, address, key) for key, address in host_refs]
        engines = [Actor(EngineService, address, key) for key, address in engine_refs]
        self.service = build_rollout_service(run, engines, hosts, version, shard)

    def lost_engines(self) -> list[int]:
        return self.service.lost_engines()

    def replace_engine(self, index: int, ref: tuple[str, str]) -> None:
        from distributed.actor import Actor

        key, address = ref
        self.service.replace_engine(index, Actor(EngineService, address, key))

    def start(self) -> dict[str, Any]:
        self.service.start()
        return worker_identity()

    def where(self) -> dict[str, Any]:
        return worker_identity()

    async def take_batch(self, update: int) -> tuple[list[Trajectory], dict[str, Any]]:
        """Waits for the batch; ends with `RolloutBroken` once the service cannot make one
        (checked every `BROKEN_POLL_S`), so the driver can hand its state to a replacement."""
        t0 = last = time.perf_counter()
        while (out := self.service.try_take(update)) is None:
            await asyncio.sleep(0.02)
            if time.perf_counter() - last > self.BROKEN_POLL_S:
                last = time.perf_counter()
                if (why := self.service.broken()) is not None:
                    raise RolloutBroken(f"rollout service broken: {why}")
        out[1]["metrics"]["rollout/wait_s"] = time.perf_counter() - t0
        return out

    def try_take(self, update: int) -> tuple[list[Trajectory], dict[str, Any]] | None:
        """This shard's part of update `update`, or None yet (rollart/rollout/shards.py)."""
        return self.service.try_take(update)

    def set_version(self, version: int) -> None:
        self.service.set_version(version)

    def snapshot(self) -> tuple[bytes | None, list[Trajectory]]:
        return self.service.snapshot()

    def handover(self) -> tuple[bytes | None, list[Trajectory]]:
        return self.service.handover()

    def restore_state(self, state: bytes, trajs: list[Trajectory]) -> dict[str, int]:
        return self.service.restore_state(state, trajs)

    def stats(self) -> dict[str, Any]:
        return self.service.stats()

    def stop(self) -> dict[str, Any]:
        return self.service.stop()
