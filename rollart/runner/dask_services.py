"""The run's long-lived services as Dask actors, each pinned to a worker of its hardware class
(the `ServiceFactory` of `rollart/runner/driver.py` for a Dask cluster; no Prefect here).

    trainer        one actor on the `trainer` class; with `train.world_size` N > 1, N actors
                   (ranks) on N workers of that class behind a TrainerGroup
    engines        one replica per entry of `cluster.engine_pools` (default: `engine.replicas`
                   on the `engine` class), each on its class; submitted before the trainer
                   is built (`begin`), so their start-ups overlap
    env hosts      one actor per worker of the `env` class: losing one costs only its episodes
    rollout        the rollout service, on the first env worker; with `rollout.shards` n,
                   n actors spread over the env workers behind a ShardedRollout
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast
from urllib.parse import urlparse

from distributed import Client
from distributed.actor import Actor

from rollart.config import RunConfig
from rollart.config.hardware import worker_classes
from rollart.handles import call
from rollart.rollout.env_host import EnvHostService
from rollart.rollout.shards import ShardedRollout
from rollart.run import RunSpec
from rollart.runner.driver import Placement
from rollart.service_protocols import EngineAPI, RolloutAPI, TrainerAPI
from rollart.services import EngineService, RolloutServiceActor, TrainerService
from rollart.services.trainer_group import TrainerGroup
from rollart.storage.background import flush_all

log = logging.getLogger("rollart")
# After a restart, how long a sharded trainer waits for all its workers before it resumes on
# fewer ranks.
RANK_WAIT_S = 60.0
# How often a build pinned to one worker checks that the worker is still there.
PIN_POLL_S = 1.0


def check_classes(client: Client, cfg: RunConfig) -> dict[str, list[str]]:
    """Every class the config maps a stage or an engine pool to has a worker; else one line
    saying how to fix it."""
    have = worker_classes(client)
    wanted = set(cfg.cluster.stages.values()) | set(cfg.cluster.engine_classes(cfg.engine.replicas))
    missing = sorted(c for c in wanted if c not in have)
    if missing:
        raise RuntimeError(
            f"no Dask worker carries resource(s) {missing}; start workers with "
            f"`dask worker --resources {missing[0]}=1` or fix cluster.stages"
        )
    return have


class DaskServices:
    """Creates the services as actors on `client`'s cluster and records where they went."""

    def __init__(self, client: Client, run: RunSpec, placed: Placement) -> None:
        self.client, self.run, self.placed = client, run, placed
        self.roles = run.cfg.cluster.stages
        self.classes = check_classes(client, run.cfg)
        self.attempt = 0  # a fresh set of actor keys per (re)start of the run's services
        self.engine_addr: dict[int, str] = {}  # replica index -> its worker
        self.replacements = 0
        self.rollouts = 0  # rollout services built: a replacement (a rebuild) gets a new key
        self.building: dict[int, tuple[Any, str]] = {}  # replica index -> (actor future, worker)
        self.trainer_workers: list[str] = []  # a sharded trainer's ranks' workers, by rank
        self.ahead: list[Any] = []  # engine actor futures submitted by `begin`, by replica

    def restart(self) -> None:
        """Before the services are created again (a lost trainer or rollout service): fresh
        actor keys, and the workers that are there now. The workers of a sharded trainer's
        old ranks are restarted first: a rank whose peer was lost sits in a collective until
        train.dist_timeout_s, holding its worker's actor thread and its process group."""
        self.attempt += 1
        self._drop_ahead()
        if self.trainer_workers:
            present = set(worker_classes(self.client).get(self.roles["trainer"], []))
            old = [w for w in self.trainer_workers if w in present]
            if old:
                self.client.restart_workers(old, timeout=self.run.cfg.cluster.call_timeout_s,
                                            raise_for_error=False)
            self.trainer_workers = []
        # The lost worker's replacement (a nanny restart, the cluster manager) may still be on
        # its way: wait for every class, as long as a call may take.
        deadline = time.monotonic() + self.run.cfg.cluster.call_timeout_s
        while True:
            try:
                self.classes = check_classes(self.client, self.run.cfg)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        # A sharded trainer waits a while more for all its workers, then goes on with fewer
        # ranks (its checkpoint resumes at any world size).
        want, hw = self.run.cfg.train.world_size, self.roles["trainer"]
        deadline = time.monotonic() + min(RANK_WAIT_S, self.run.cfg.cluster.call_timeout_s)
        while len(self.classes.get(hw, [])) < want and time.monotonic() < deadline:
            time.sleep(0.5)
            self.classes = check_classes(self.client, self.run.cfg)
        self.engine_addr.clear()
        self.building.clear()

    def begin(self) -> None:
        """Submit the engines' creation before the trainer's, so that they load at once
        (each on its own worker process: a model, and for vLLM its import and start-up) and
        the run's start-up costs the longest of them, not their sum. Only where each build
        has a process to itself (`_separate`); elsewhere `engines` builds them after the
        trainer, one after another, as before."""
        if self._separate():
            self._drop_ahead()
            self.ahead = self._submit_engines()

    def _separate(self) -> bool:
        """No worker carries two of the classes the trainer and the engines are built on, so
        no process (and its device) would build two services side by side."""
        cfg = self.run.cfg
        seen: set[str] = set()
        for hw in {self.roles["trainer"], *cfg.cluster.engine_classes(cfg.engine.replicas)}:
            workers = set(self.classes.get(hw, []))
            if workers & seen:
                return False
            seen |= workers
        return True

    def _drop_ahead(self) -> None:
        for fut in self.ahead:  # an earlier attempt's: its keys are not this attempt's
            fut.release()
        self.ahead = []

    def _actor(self, cls: type, *args: Any, **where: Any) -> Any:
        """An actor of `cls` (typed by the caller: a service's Protocol)."""
        return self.client.submit(cls, self.run, *args, actor=True, **where).result()

    def trainer(self) -> TrainerAPI:
        # A key per attempt: a restarted run never gets the lost trainer's key (which Dask may
        # still be re-creating on the restarted worker) back as its "new" trainer.
        hw = self.roles["trainer"]
        want = self.run.cfg.train.world_size
        world = min(want, len(self.classes.get(hw, []))) if self.attempt else want
        if world < want:
            log.warning("%d of %d trainer-class workers: the trainer resumes on %d rank(s)",
                        world, want, world)
        if world <= 1:
            actor: TrainerAPI = self._actor(TrainerService, resources={hw: 1},
                                            key=f"trainer-{self.run.run_id}-{self.attempt}")
            self.placed("trainer_service", call(actor).where())
            return actor
        return self._trainer_group(world)

    def _trainer_group(self, world: int) -> TrainerGroup:
        """`world` ranks, one per trainer-class worker, meeting at rank 0's worker (its host,
        a port it found free). They are created at once: each waits in the rendezvous for
        the others (up to train.dist_timeout_s)."""
        hw = self.roles["trainer"]
        workers = self.classes.get(hw, [])
        if len(workers) < world:
            raise RuntimeError(
                f"train.world_size is {world} but the cluster has {len(workers)} worker(s) of "
                f"the trainer class {hw}: start more (`dask worker --resources {hw}=1`) or "
                "lower train.world_size")
        workers = sorted(workers)[:world]
        host = urlparse(workers[0]).hostname or "127.0.0.1"
        from rollart.train.distributed import free_port  # torch: not on import of this module

        port = self.client.run(free_port, host, workers=[workers[0]])[workers[0]]
        futures = [self.client.submit(
            TrainerService, self.run, r, world, (host, port), actor=True, workers=[addr],
            resources={hw: 1}, key=f"trainer-{self.run.run_id}-{self.attempt}-r{r}")
            for r, addr in enumerate(workers)]
        self.trainer_workers = workers
        group = TrainerGroup([f.result() for f in futures])
        self.placed("trainer_service", group.where())
        return group

    def _submit_engines(self) -> list[Any]:
        """One actor future per engine replica, on its class."""
        cfg = self.run.cfg
        return [self._submit_engine(r, hw)
                for r, hw in enumerate(cfg.cluster.engine_classes(cfg.engine.replicas))]

    def _submit_engine(self, replica: int, hw: str) -> Any:
        return self.client.submit(EngineService, self.run, replica, actor=True,
                                  resources={hw: 1},
                                  key=f"engine-{self.run.run_id}-{self.attempt}-{replica}")

    def engines(self) -> list[EngineAPI]:
        """The engine replicas: those `begin` submitted, else built now, one after another."""
        cfg = self.run.cfg
        ahead, self.ahead = self.ahead, []
        out = []
        for r, hw in enumerate(cfg.cluster.engine_classes(cfg.engine.replicas)):
            actor: EngineAPI = (ahead[r] if ahead else self._submit_engine(r, hw)).result()
            self.engine_addr[r] = self.placed("engine_service", call(actor).where())["address"]
            out.append(actor)
        return out

    def replace_engine(self, index: int) -> EngineAPI | None:
        """A new replica `index` on a worker of its class that holds no other replica (one
        that (re)joined), or None while there is none or it is still being built (the next
        call picks it up: one creation per replica at a time). The lost replica's own worker is
        not used: it may be hung rather than gone, and the supervisor probes it instead."""
        cfg = self.run.cfg
        if index in self.building:
            fut, addr = self.building[index]
            if not fut.done():
                return None
            del self.building[index]
            if fut.status != "finished":  # its worker went too: try another at the next call
                return None
            actor: EngineAPI = fut.result()
            self.engine_addr[index] = self.placed("engine_service",
                                                  call(actor).where())["address"]
            return actor
        hw = cfg.cluster.engine_classes(cfg.engine.replicas)[index]
        taken = set(self.engine_addr.values()) | {a for _, a in self.building.values()}
        free = [a for a in worker_classes(self.client).get(hw, []) if a not in taken]
        if free:
            self.replacements += 1
            self.building[index] = (self.client.submit(
                EngineService, self.run, index, actor=True, workers=[free[0]],
                resources={hw: 1},
                key=f"engine-{self.run.run_id}-{self.attempt}-{index}-r{self.replacements}",
            ), free[0])
        return None

    def engine_ref(self, engine: Any) -> tuple[str, str]:
        """(actor key, worker address) of an engine actor."""
        return engine.key, engine._address

    def env_hosts(self) -> list[Actor]:
        """One env host per worker of the env class. A worker that leaves before its host is
        built (the env pool scaled down while the trainer and engines loaded, a worker its
        nanny restarted under a new address) is skipped; with none left, the class is read
        again and the hosts go on the workers there now."""
        hw, hosts, tried = self.roles["env"], list[Actor](), set[str]()
        deadline = time.monotonic() + self.run.cfg.cluster.call_timeout_s
        while True:
            for addr in [a for a in self.classes.get(hw, []) if a not in tried]:
                tried.add(addr)
                host = self._built_on(addr, self.client.submit(
                    EnvHostService, self.run, actor=True, workers=[addr],
                    key=f"env-host-{self.run.run_id}-{self.attempt}-{len(tried) - 1}"))
                if host is None:
                    log.warning("env worker %s left before its env host was built", addr)
                else:
                    hosts.append(host)
            if hosts:
                return hosts
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker of the env class {hw} stayed long enough to "
                                   f"build an env host within cluster.call_timeout_s "
                                   f"({self.run.cfg.cluster.call_timeout_s:.0f} s)")
            time.sleep(0.5)
            self.classes = worker_classes(self.client)

    def _pinned(self, addr: str, fut: Any) -> Any:
        """The rollout service's actor on env worker `addr`, which holds an env host (so the
        env pool's scaling keeps it): only a dead worker fails it, and the error names it."""
        actor = self._built_on(addr, fut)
        if actor is None:
            raise OSError(f"env worker {addr} left before the rollout service was built")
        return actor

    def _built_on(self, addr: str, fut: Any) -> Any | None:
        """The actor `fut` builds on worker `addr`, or None if `addr` left first: Dask holds
        a task pinned to a departed worker forever."""
        while True:
            try:
                return fut.result(timeout=PIN_POLL_S)
            except TimeoutError:
                if addr not in self.client.scheduler_info(n_workers=-1)["workers"]:
                    fut.cancel()
                    return None

    def rollout(self, engines: list[EngineAPI], hosts: list[Any], version: int) -> RolloutAPI:
        """The rollout service as an actor, or with `rollout.shards` n > 1 a ShardedRollout of
        n actors, shard k on env worker k mod (env workers)."""
        # The rollout service reaches hosts by (key, address), not as task dependencies: a lost
        # env worker must not take the service's own actor down with it. It lives with the first
        # env host(s); losing that worker ends the run (resume from the last checkpoint).
        refs = [(h.key, self.placed("env_host", call(h).stats())["address"]) for h in hosts]
        engine_refs = [self.engine_ref(e) for e in engines]
        # On the hosts' workers, not the class's workers as first read: those may have gone.
        n, workers = self.run.cfg.rollout.shards, list(dict.fromkeys(a for _, a in refs))
        self.rollouts += 1
        if n == 1:
            again = f"-g{self.rollouts}" if self.rollouts > 1 else ""
            # The actor answers `take_batch` with its coroutine's value: it is a RolloutAPI.
            return cast(RolloutAPI, self._pinned(workers[0], self.client.submit(
                RolloutServiceActor, self.run, engine_refs, refs, version, actor=True,
                workers=[workers[0]], key=f"rollout-{self.run.run_id}-{self.attempt}{again}")))
        futures = [(workers[k % len(workers)], self.client.submit(
            RolloutServiceActor, self.run, engine_refs, refs, version, (k, n), actor=True,
            workers=[workers[k % len(workers)]],
            key=f"rollout-{self.run.run_id}-{self.attempt}-s{k}")) for k in range(n)]
        shards: list[RolloutServiceActor] = [self._pinned(a, f) for a, f in futures]
        for s in shards:
            self.placed("rollout_shard", call(s).where())
        return ShardedRollout(cast(list[RolloutAPI], shards))  # actor handles, as above

    def host_stats(self, hosts: list[Any]) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for h in hosts:
            try:
                out.append(h.stats().result(timeout=10))
            except Exception:  # its worker is gone
                out.append(None)
        return out

    def flush_shards(self) -> int:
        """Every worker writes the Parquet shards it buffers. A worker the scheduler still lists
        but that is gone (a lost host, before its heartbeat times out) answers with a closed
        connection: it has nothing left to flush, and the run must not fail on it at the end.
        Any other error (a live worker that could not write) is raised."""
        out = self.client.run(flush_all, on_error="return")
        for v in out.values():
            if isinstance(v, BaseException) and not isinstance(v, OSError):
                raise v  # CommClosedError is an OSError: the worker is gone
        return sum(v for v in out.values() if isinstance(v, int))
