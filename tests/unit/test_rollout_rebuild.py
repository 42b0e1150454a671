"""A rollout service that breaks while its process lives is rebuilt from its live state
(rollart/runner/recovery.py `rebuild_rollout`): same trainer, engines and env hosts, nothing
reloaded,
every sample id still consumed or dropped exactly once. Anything else falls back to the restart
from the checkpoint."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollart.config import load_config
from rollart.rollout.service_failures import RolloutBroken
from rollart.run import RunSpec
from rollart.runner.driver import InProcessRunner, IterationDriver
from rollart.runner.local_loop import LocalServices
from rollart.runner.recovery import lost_service, rebuild_rollout, rollout_broken
from rollart.storage.ledger import SampleLedger

CONFIG = str(Path(__file__).parents[2] / "configs" / "default.yaml")
BASE = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "storage.save_every=3", "iterations=3"]


def _break_batchers(service: Any) -> None:
    """End the service's batcher threads as a crash in them would (the service itself is not
    stopping, its process and state live on)."""
    for b in service.batchers:
        with b.cv:
            b.stopping = True
            b.cv.notify_all()
        b.thread.join(timeout=5.0)
        assert not b.thread.is_alive()


def test_a_broken_rollout_service_is_rebuilt_from_its_live_state(tmp_path):
    cfg = load_config(CONFIG, [f"storage.root={tmp_path}", *BASE])
    run = RunSpec(cfg, "rebuild")
    driver = IterationDriver(run, InProcessRunner(), LocalServices(run))
    trainer = None
    try:
        assert driver.start() == 0
        assert driver.svc is not None
        trainer, old = driver.svc.trainer, driver.svc.rollout
        driver.iteration(0)  # update 1's groups are now running on the old service
        assert old.broken() is None
        _break_batchers(old)
        assert "rollout-batcher" in (old.broken() or "")
        driver.iteration(1)  # its collect fails with RolloutBroken; rebuilt; run again
        driver.iteration(2)
        done = driver.finish()
    except BaseException:
        driver.abort()
        raise
    new = driver.svc.rollout
    assert new is not old and driver.svc.trainer is trainer  # nothing else was rebuilt
    assert old.stopping and new.broken() is None
    [event] = done["rollout"]["rebuilt"]
    assert event["iteration"] == 1 and "RolloutBroken" in event["error"]
    restored = event["restored"]
    # update 1's two groups were running: their running members are dropped as interrupted
    # and new members re-issued; none had finished (the batcher died before their turns).
    assert restored["groups"] == 2 and restored["interrupted"] >= 1
    assert restored["relaunched"] >= restored["interrupted"]
    files, _ = driver.store.load_checkpoint(3, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    assert max(Counter(ledger.ids()).values()) == 1  # nobody consumed or dropped twice
    c = ledger.counts()
    assert c["consumed"] == 3 * 2 * 2 and c["pending"] == 0
    dropped = [r for r in ledger.records if r[2] == "dropped"]
    interrupted = [r for r in dropped if "interrupted" in r]
    assert len(interrupted) == restored["interrupted"] and len(dropped) == c["dropped"]
    # A turn that reached the dead batcher before the rebuild fails its episode (re-issued,
    # so every update still gets its groups); it never counts as a finished member. On a
    # loaded host the re-issued members can reach the dead batcher too, until a group's retry
    # budget is spent: its last running members are then dropped with it and a new group
    # takes its slot (the counts above hold either way).
    failed = ("interrupted", "engine_error", "group_dropped")
    other = [r for r in dropped if not any(reason in r for reason in failed)]
    assert not other, other


class _Svc:
    def __init__(self, rollout: Any) -> None:
        self.trainer, self.engines, self.hosts, self.rollout = _Gone(), [], [], rollout


class _Gone:
    def handover(self) -> Any:
        raise ConnectionError("its worker left the cluster")

    def stats(self) -> dict:
        return {}

    def where(self) -> dict:
        return {}


class _Driver:
    def __init__(self, shards: int = 1) -> None:
        self.cfg = load_config(None, [f"rollout.shards={shards}"])
        self.svc = _Svc(_Gone())
        self.supervisor = None


def test_only_a_broken_service_with_reachable_state_is_rebuilt():
    broken = RuntimeError("collect failed")
    broken.__cause__ = RolloutBroken("rollout service broken: its thread(s) x ended")
    assert rollout_broken(broken) and rollout_broken(RuntimeError("rollout service broken: y"))
    assert not rollout_broken(TimeoutError("no batch"))
    # Another failure, a sharded service, or the state unreachable: the checkpoint path.
    assert rebuild_rollout(_Driver(), TimeoutError("x"), 1) is None
    assert rebuild_rollout(_Driver(shards=2), broken, 1) is None
    assert rebuild_rollout(_Driver(), broken, 1, probe_timeout_s=1.0) is None
    # ... where the broken service counts as lost, so the run restarts instead of failing.
    assert lost_service(_Driver(), 1.0, broken) == "rollout service"
    assert lost_service(_Driver(), 1.0, TimeoutError("x")) is None


def test_broken_names_dead_threads_only_while_started_and_not_stopping():
    from rollart.rollout.service_failures import ReplicaFailures

    class S(ReplicaFailures):
        def __init__(self) -> None:
            self.started, self.stopping, self.runner = False, False, None
            done = threading.Thread(target=lambda: None, name="rollout-batcher")
            done.start()
            done.join()
            self.batchers = [type("B", (), {"thread": done})()]
            self._watchdog = threading.current_thread()

    s = S()
    assert s.broken() is None  # not started yet
    s.started = True
    assert s.broken() == "its thread(s) rollout-batcher ended"
    s.stopping = True
    assert s.broken() is None


def test_asyncio_runner_dead_loop_thread_is_broken():
    from rollart.rollout.service_failures import ReplicaFailures

    class S(ReplicaFailures):
        def __init__(self) -> None:
            self.started, self.stopping, self.batchers = True, False, []
            t = threading.Thread(target=lambda: None, name="rollout-loop")
            t.start()
            t.join()
            self.runner = type("R", (), {"thread": t})()
            self._watchdog = None

    assert S().broken() == "its thread(s) rollout-loop ended"


class _CrashingEngine:
    """An engine call during which the batcher's thread ends (an uncaught BaseException, as the
    chaos benchmark's SystemExit), once `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def generate(self, requests: list[Any]) -> list[Any]:
        self.go.wait(5.0)
        raise SystemExit


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_batcher_thread_that_dies_mid_call_leaves_no_episode_waiting():
    from rollart.rollout.batcher import EngineBatcher, EpisodeCancelled, LiveEpisode
    from rollart.rollout.scheduler import Start
    from rollart.types import GenerationRequest

    engine = _CrashingEngine()
    b = EngineBatcher(engine, max_batch=1, wait_s=0.0)
    b.thread = threading.Thread(target=b.loop, name="rollout-batcher", daemon=True)
    b.thread.start()

    outcomes: dict[int, BaseException | None] = {}

    def turn(i: int) -> None:
        live = LiveEpisode(Start(f"e{i}", "g", "t", i, 0), engine=0, host=0)
        try:
            b.generate(GenerationRequest(f"r{i}", [1, 2]), live)
            outcomes[i] = None
        except BaseException as err:  # noqa: BLE001 - the outcome is the test's subject
            outcomes[i] = err

    waiting = [threading.Thread(target=turn, args=(i,), daemon=True) for i in range(3)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 10.0
    while len(b.queue) + len(getattr(b, "_in_hand", [])) < 2:  # one in the call, two queued
        assert time.monotonic() < deadline, "the turns never reached the batcher"
        time.sleep(0.01)
    engine.go.set()
    b.thread.join(timeout=5.0)
    assert not b.thread.is_alive() and not outcomes
    # Until the broken service is stopped (its rebuild does that first) its episodes wait:
    # were they failed now, they would count as failed episodes, not interrupted ones.
    b.stop()
    for t in waiting:
        t.join(timeout=5.0)
    assert len(outcomes) == 3 and all(isinstance(o, EpisodeCancelled)
                                      for o in outcomes.values()), outcomes
    turn(9)
    assert isinstance(outcomes[9], EpisodeCancelled)  # a later turn is refused at once
