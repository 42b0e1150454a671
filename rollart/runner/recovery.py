"""Bringing lost engine replicas back (the driver's side of engine failover).

The rollout service marks a replica lost when a call to it fails like a lost worker
(`rollart/rollout/failover.py`) and re-issues its turns on the others. `EngineSupervisor` runs
in the driver's process, which holds the cluster client, and every `poll_s`:

- asks the rollout service which replicas are lost;
- probes each lost replica's own actor (a worker that was only hung, e.g. stopped and continued,
  answers again), else asks the factory for a replacement actor on a worker of the replica's
  class that serves no other replica (a worker that (re)joined: a nanny restart, a cluster
  manager's replacement); none yet, or still being built: it asks again at the next poll;
- loads the trainer's current weights into it (the same push as `sync_weights`), then hands it
  to the rollout service, which puts it back into rotation.

Sync, checkpoint and evaluation run on `serving()` (lost replicas are skipped); a checkpoint
records an empty RNG state for a lost replica's slot (`slots()`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from rollart.handles import call, release
from rollart.rollout.failover import is_replica_loss
from rollart.rollout.service_failures import RolloutBroken
from rollart.service_protocols import EngineAPI, RolloutAPI
from rollart.types import Trajectory

log = logging.getLogger("rollart")


class HandsOver(Protocol):
    """A single rollout service (not a sharded one): its live state for a replacement."""

    def handover(self) -> tuple[bytes | None, list[Trajectory]]: ...


class EngineFactory(Protocol):
    def replace_engine(self, index: int) -> Any | None: ...
    def engine_ref(self, engine: Any) -> Any: ...


class EngineSupervisor:
    def __init__(self, engines: list[EngineAPI], trainer: Any, rollout: RolloutAPI,
                 factory: EngineFactory, push: Any, poll_s: float = 1.0,
                 probe_timeout_s: float = 5.0) -> None:
        """`engines` is the driver's list of replica handles, updated in place on replacement;
        `push(trainer, engines)` loads the trainer's current weights into `engines`."""
        self.engines, self.trainer, self.rollout = engines, trainer, rollout
        self.factory, self.push = factory, push
        self.poll_s, self.probe_timeout_s = poll_s, probe_timeout_s
        self.lock = threading.Lock()
        self.lost: set[int] = set()
        self.events: list[dict[str, Any]] = []  # one per replica brought back
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the stages see ----------------------------------------------------------------
    def serving(self) -> list[Any]:
        with self.lock:
            return [e for i, e in enumerate(self.engines) if i not in self.lost]

    def slots(self) -> list[Any | None]:
        """One entry per replica index: its handle, or None while it is lost."""
        with self.lock:
            return [None if i in self.lost else e for i, e in enumerate(self.engines)]

    # ---- the loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-supervisor")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout_s + 5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check_once()
            except Exception as err:  # e.g. the rollout service's worker is gone: the driver
                text = f"{type(err).__name__}: {err}"  # sees that on its own
                if not self.errors or self.errors[-1] != text:  # once per distinct error,
                    log.warning("engine supervisor: %s", text)  # not once per second
                self.errors.append(text)
                del self.errors[:-100]

    def check_once(self) -> list[int]:
        """One round: returns the replica indices brought back."""
        lost = set(call(self.rollout).lost_engines())
        with self.lock:
            self.lost = lost
        back = []
        for i in sorted(lost):
            if self._stop.is_set():
                break
            if self._revive(i):
                back.append(i)
        return back

    def _answers(self, engine: Any) -> bool:
        try:
            call(engine, timeout=self.probe_timeout_s).weight_version()
            return True
        except Exception as err:
            if is_replica_loss(err):
                return False
            raise

    def _revive(self, index: int) -> bool:
        t0 = time.time()
        old = self.engines[index]
        how = "probe"
        engine = old if self._answers(old) else None
        if engine is None:
            engine, how = self.factory.replace_engine(index), "replacement"
            if engine is None:
                return False  # no free worker of its class yet
        self.push(self.trainer, [engine])
        call(self.rollout).replace_engine(index, self.factory.engine_ref(engine))
        if engine is not old:
            release(old)
        with self.lock:
            self.engines[index] = engine
            self.lost.discard(index)
        self.events.append({"replica": index, "how": how, "t": time.time(),
                            "revive_s": time.time() - t0})
        log.info("engine replica %d back in rotation (%s)", index, how)
        return True


# ---- a broken rollout service whose process lives: its live state into a replacement ------

def rollout_broken(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from) says the rollout service is broken
    (`RolloutBroken`; by its text too: a task runner may re-raise it as another type)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RolloutBroken) or "rollout service broken:" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def rebuild_rollout(driver: Any, err: BaseException, iteration: int,
                    probe_timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The rollout service broke while its worker (and so its memory) lives: a replacement
    on a worker of its class receives the old one's live state (`handover`: the finished
    members of unconsumed groups, drops not yet handed on; running members are dropped as
    interrupted and re-issued, as on resume) and serves from `iteration` on, with the same
    engines, env hosts and trainer: nothing is reloaded from a checkpoint. Returns the event,
    or None when this cannot be done (another failure, a sharded service, the old one's
    worker gone: the caller falls back to a restart from the checkpoint)."""
    svc = driver.svc
    if svc is None or driver.cfg.rollout.shards != 1 or not rollout_broken(err):
        return None
    t0 = time.time()
    old = svc.rollout
    try:
        state, pending = call(cast(HandsOver, old), timeout=probe_timeout_s).handover()
    except Exception as gone:  # its worker went too: the checkpoint path
        log.warning("rollout service broken and its state unreachable (%s): restart from "
                    "the checkpoint", gone)
        return None
    new: RolloutAPI = driver.factory.rollout(svc.engines, svc.hosts, iteration)
    restored = call(new).restore_state(state, pending) if state is not None else {}
    driver.placed("rollout_service", call(new).start() or {})
    svc.rollout = new
    if driver.supervisor is not None:
        driver.supervisor.rollout = new
    release(old)
    event = {"iteration": iteration, "error": f"{type(err).__name__}: {err}"[:300],
             "failed_at": t0, "rebuilt_at": time.time(), "rebuild_s": time.time() - t0,
             "restored": restored, "pending_handed_over": len(pending)}
    log.warning("rollout service broken (%s); rebuilt from its live state in %.1f s "
                "(%s)", err, event["rebuild_s"], restored or "nothing pending")
    return event


# ---- losing a stateful service: restart the run's services from the latest checkpoint ------

def lost_service(driver: Any, probe_timeout_s: float = 10.0,
                 err: BaseException | None = None) -> str | None:
    """After a failure: which stateful service no longer answers ("trainer", "rollout
    service") or is broken (`err` says so and its state could not be handed over), or None
    (they answer: the failure was something else, not retried here). A service still busy
    with the call that timed out answers only after it (an actor runs one call at a time),
    so the probe waits as long as a call may take."""
    svc = driver.svc
    if svc is None:
        return None
    if err is not None and rollout_broken(err):
        return "rollout service"
    for name, handle, method in (("trainer", svc.trainer, "where"),
                                 ("rollout service", svc.rollout, "stats")):
        try:
            call(handle, method, timeout=probe_timeout_s)
        except Exception as err:
            if is_replica_loss(err):
                return name
            raise
    return None


def run_with_restarts(make_driver: Callable[[int], Any], store: Any, max_restarts: int | None,
                      resume_step: int | None,
                      on_iteration: Callable[[Any], None] | None = None,
                      on_restart: Callable[[dict[str, Any]], None] | None = None,
                      probe_timeout_s: float = 10.0,
                      stop_when: Callable[[list[float]], bool] | None = None,
                      ) -> tuple[Any, list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """Run the driver `make_driver(attempt)` builds to the end. When the trainer or the
    rollout service is lost (its worker died or hung past the call deadline), every service
    is created again (new actors, on the workers of their classes that are there now) and the
    run resumes from the latest complete checkpoint, as `--resume` does (store rolled back to
    it, ledger and pending groups restored, the same sample ids and seeds re-issued), at most
    `max_restarts` times; then, or before the first checkpoint, the run fails naming the cause.
    `max_restarts=None`: the mode cannot restart (one process: nothing is lost apart from it),
    so any failure, an interrupt included, aborts the driver and propagates as it is.
    Returns (driver, curve, finish(), restarts)."""
    from rollart.storage.resume import ResumeError, prepare_resume

    restarts: list[dict[str, Any]] = []
    attempt = 0
    while True:
        driver = make_driver(attempt)
        try:
            first = driver.start(resume_step)
            curve = driver.iterations(first, on_iteration, stop_when)
            return driver, curve, driver.finish(), restarts
        except BaseException as err:
            if max_restarts is None:  # its services live in this process: stop their threads
                driver.abort()
                raise
            if not isinstance(err, Exception):  # an interrupt ends the flow and its cluster
                raise
            t_fail = time.time()
            lost = lost_service(driver, probe_timeout_s, err)
            driver.abort()
            if lost is None:
                raise
            driver.release()
            if attempt >= max_restarts:
                raise RuntimeError(f"the {lost} was lost again after {attempt} restart(s) "
                                   f"(cluster.max_restarts={max_restarts}): {err}") from err
            try:
                point = prepare_resume(store)
            except ResumeError as none:
                raise RuntimeError(f"the {lost} was lost before the run's first complete "
                                   f"checkpoint ({none}); nothing to restart from") from err
            attempt += 1
            resume_step = point.step
            restarts.append({"lost": lost, "error": f"{type(err).__name__}: {err}"[:300],
                             "failed_at": t_fail, "restarted_at": time.time(),
                             "from_checkpoint": point.step, "attempt": attempt})
            log.warning("the %s was lost (%s); restarting from checkpoint %d (restart %d of "
                        "%d)", lost, err, point.step, attempt, max_restarts)
            if on_restart is not None:
                on_restart(restarts[-1])
