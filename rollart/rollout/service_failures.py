"""Lost engine replicas and env hosts, as the rollout service handles them (a mixin of
RolloutService, rollart/rollout/service.py): which replica an orphaned episode moves to, a
replica taken out of rotation and put back, a host routed around, the env-timeout watchdog
that fails a hung env call (a hung env costs one episode) and probes its host, and the service
itself broken while its process lives (`broken`, `handover`: the driver moves its live state
into a replacement, rollart/runner/recovery.py `rebuild_rollout`)."""

from __future__ import annotations

import time
from typing import Any

from rollart.rollout.batcher import LiveEpisode
from rollart.rollout.failover import ReplicaLost


class RolloutBroken(RuntimeError):
    """The rollout service can no longer make progress though its process (and its state)
    lives: a thread it runs on has ended. Its state can be handed over (`handover`)."""


class ReplicaFailures:
    """Expects RolloutService's attributes (lock, live, on_engine, health, routing, batchers,
    hosts, hosts_alive, totals, recent_errors, cfg) and its `_failed` / `_spawn`."""

    lock: Any
    live: dict[str, LiveEpisode]
    on_engine: Any
    health: Any
    routing: Any
    batchers: list[Any]
    hosts: list[Any]
    hosts_alive: list[bool]
    host_events: list[dict[str, Any]]
    totals: Any
    recent_errors: Any
    cfg: Any
    stopping: bool
    _probing: set[int]
    _failed: Any
    _spawn: Any
    _watchdog: Any
    runner: Any
    started: bool

    def broken(self) -> str | None:
        """Why the started service cannot go on though its process lives (a thread it runs on
        ended while it was not stopping: a bug, an uncaught error), else None. Episode
        threads are not counted: each ends with its episode."""
        if not self.started or self.stopping:
            return None
        threads = ([self.runner.thread] if self.runner is not None
                   else [*(b.thread for b in self.batchers), self._watchdog])
        dead = sorted({t.name for t in threads if t is not None and not t.is_alive()})
        return f"its thread(s) {', '.join(dead)} ended" if dead else None

    def handover(self) -> tuple[bytes | None, list[Any]]:
        """Stop this (broken) service and return its live state for a replacement: what a
        checkpoint's snapshot holds (rollart/rollout/snapshot.py), taken now. The replacement
        keeps the finished members of unconsumed groups and the drops not yet handed to the
        trainer; members that were running are dropped as `interrupted` and re-issued."""
        self.stop()  # type: ignore[attr-defined]
        return self.snapshot()  # type: ignore[attr-defined]

    def move_engine(self, live: LiveEpisode, alive: list[int]) -> None:
        """`live`'s replica is gone: it goes on with the alive replica with fewest episodes."""
        with self.lock:
            counted = self.live.get(live.id) is live
            if counted:
                self.on_engine[live.engine] -= 1
            live.engine = min(alive, key=lambda i: self.on_engine[i])
            if counted:
                self.on_engine[live.engine] += 1

    def engine_lost(self, index: int, err: BaseException | str) -> None:
        """Take replica `index` out of rotation: the router fails its outstanding turns over,
        its queued turns return to their episodes, which re-issue them on the others."""
        why = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if not self.health.mark_lost(index, why):
            return
        self.routing.failed(index)
        self.recent_errors.append(f"engine replica {index} lost: {why}")
        self.batchers[index].fail_queued(ReplicaLost(f"engine replica {index} lost"))
        with self.lock:
            self.lock.notify_all()

    def replace_engine(self, index: int, engine: Any) -> None:
        """A replacement for lost replica `index` (serving the current weights) joins the
        rotation; episodes waiting for a replica go on."""
        self.batchers[index].engine = engine
        self.routing.recovered(index)
        self.health.mark_back(index)
        self.totals.counters["engines_replaced"] += 1

    def lost_engines(self) -> list[int]:
        return self.health.lost_indices()

    def host_lost(self, index: int) -> None:
        """Route around a lost host; its episodes fail now (and are re-issued elsewhere)."""
        with self.lock:
            if not self.hosts_alive[index]:
                return
            self.hosts_alive[index] = False
            self.totals.counters["hosts_lost"] += 1
            self.host_events.append({"host": index, "event": "lost", "t": time.time()})
            self.recent_errors.append(f"env host {index} lost")
            stranded = [x for x in self.live.values() if x.host == index]
        for live in stranded:
            self._failed(live, "host_lost", timeout=False)

    def _probe(self, index: int) -> None:
        """After a timeout: is the host itself still there? (A call to an actor whose worker
        died can hang instead of raising, so a short liveness call decides.)"""
        try:
            out = self.hosts[index].stats()
            if hasattr(out, "result"):
                out.result(timeout=min(5.0, self.cfg.rollout.env_timeout_s))
        except Exception:
            self.host_lost(index)
        finally:
            self._probing.discard(index)

    def _watch(self) -> None:
        while not self.stopping:
            time.sleep(0.05)
            now = time.monotonic()
            for live in list(self.live.values()):
                if live.deadline is not None and now > live.deadline:
                    self._expired(live)

    def _expired(self, live: LiveEpisode) -> None:
        """An env call of `live` ran past `rollout.env_timeout_s`: the episode fails (and is
        re-issued); a probe asks whether its host is still there."""
        if live.cancelled:
            return
        self.recent_errors.append(f"{live.id}: env call past rollout.env_timeout_s "
                                  f"({self.cfg.rollout.env_timeout_s} s)")
        self._failed(live, "timeout", timeout=True)
        if live.host not in self._probing and self.hosts_alive[live.host]:
            self._probing.add(live.host)
            self._spawn(self._probe, live.host, name="rollout-probe")
