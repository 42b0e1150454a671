"""Actor calls have deadlines (issue 15, item 1): a hung service fails the call, naming itself."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster

from rollart.handles import CallTimeoutError, call, call_timeout, set_call_timeout


class Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def test_a_hung_actor_call_times_out_naming_service_and_method(client):
    actor = client.submit(Sleeper, actor=True).result()
    assert call(actor, "nap", 0.01) == 0.01  # answered within the default deadline
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError, match=r"Sleeper\.nap did not answer within 0\.3s "
                       r"\(cluster\.call_timeout_s\)"):
        call(actor, "nap", 1.0, timeout=0.3)
    assert time.monotonic() - t0 < 2.0
    old = call_timeout()
    set_call_timeout(0.2)  # the process-wide deadline, as the driver and services install it
    try:
        with pytest.raises(TimeoutError, match=r"Sleeper\.nap"):
            call(actor, "nap", 1.0)
        assert call(actor, "nap", 0.4, timeout=None) == 0.4  # no deadline when asked
    finally:
        set_call_timeout(old)


def test_a_slow_call_on_a_live_worker_goes_on_while_its_worker_beats(client, monkeypatch):
    """`while_alive` (the trainer's update): past the deadline a call whose worker still sends
    heartbeats is slow, not lost, and is answered; up to BUSY_FACTOR x the deadline, then it
    fails naming why. The same call without `while_alive` fails at the deadline."""
    import rollart.handles as h

    monkeypatch.setattr(h, "ALIVE_POLL_S", 0.2)
    monkeypatch.setattr(h, "HEARTBEAT_WINDOW_S", 1.5)  # worker heartbeats every 0.5 s
    actor = client.submit(Sleeper, actor=True).result()
    with pytest.raises(CallTimeoutError, match=r"within 0\.5s"):
        call(actor, "nap", 2.5, timeout=0.5)
    time.sleep(2.5)  # the actor runs one call at a time: let that nap end
    t0 = time.monotonic()
    assert call(actor, "nap", 1.5, timeout=0.5, while_alive=True) == 1.5  # 3x the deadline
    assert time.monotonic() - t0 < 2.5
    monkeypatch.setattr(h, "BUSY_FACTOR", 2.0)
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError, match=r"Sleeper\.nap .*its worker still alive: busy "
                       r"past 2x the deadline"):
        call(actor, "nap", 6.0, timeout=1.0, while_alive=True)
    assert 2.0 <= time.monotonic() - t0 < 4.0
    time.sleep(4.5)


def test_a_stopped_worker_fails_a_while_alive_call_at_its_deadline(monkeypatch):
    """A worker stopped (SIGSTOP: alive to the OS, no heartbeat) fails even a `while_alive`
    call once no heartbeat came for HEARTBEAT_WINDOW_S: a hang, not a slow update."""
    import os
    import signal

    import rollart.handles as h

    monkeypatch.setattr(h, "ALIVE_POLL_S", 0.2)
    monkeypatch.setattr(h, "PRESENCE_POLL_S", 0.5)
    monkeypatch.setattr(h, "HEARTBEAT_WINDOW_S", 3.0)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      worker_dashboard_address=":0") as cluster, Client(cluster) as c:
        actor = c.submit(Sleeper, actor=True).result()
        assert call(actor, "nap", 0.01, while_alive=True) == 0.01
        pid = next(iter(c.run(os.getpid).values()))
        fut_call = None
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(CallTimeoutError, match=r"no heartbeat from its worker for 3s"):
                fut_call = call(actor, "nap", 0.01, timeout=2.0, while_alive=True)
            assert 2.0 <= time.monotonic() - t0 < 7.0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert fut_call is None


class SlowLoader:
    def load_checkpoint(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_stage_task_calls_with_the_runs_deadline(client):
    """A stage submitted as a raw Dask task (the flow's threads runner) runs under the run's
    call deadline even on a worker where no service set it (a worker that rejoined mid-run)."""
    from rollart.handles import detach
    from rollart.runner.stages import run_stage

    actor = client.submit(SlowLoader, actor=True).result()
    old = call_timeout()
    set_call_timeout(None)  # a fresh worker process: no deadline installed by anyone
    try:
        t0 = time.monotonic()
        fut = client.submit(run_stage, "load_checkpoint_weights", detach(actor), 3.0,
                            call_timeout_s=0.3, pure=False)
        with pytest.raises(CallTimeoutError, match=r"SlowLoader\.load_checkpoint"):
            fut.result(timeout=10)
        assert time.monotonic() - t0 < 2.5
    finally:
        set_call_timeout(old)


def test_a_waiting_call_ends_when_its_worker_leaves_the_cluster():
    """`call_while_present` from a task on another worker (how the collect stage waits for a
    batch): no deadline while the service's worker is there (a long wait is answered), a
    `ServiceLostError` (an OSError: a lost service) soon after that worker is killed. A plain
    actor call there waits for the actor to be re-created, which a pinned actor never is; a
    `call` with a deadline ends the same way, well before its deadline."""
    import os
    import threading

    from rollart.handles import ServiceLostError, attach, call_while_present, detach

    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
                      worker_dashboard_address=":0") as cluster, Client(cluster) as c:
        a, b = sorted(c.scheduler_info()["workers"])
        ev = c.submit(threading.Event, actor=True, workers=[b]).result()  # held: kept alive
        ref = detach(ev)

        def wait_on(r, seconds):  # runs on worker a
            return call_while_present(attach(r), "wait", seconds, poll_s=0.2)

        def call_on(r, seconds):  # a call with a 120 s deadline, also on worker a
            return call(attach(r), "wait", seconds, timeout=120)

        # Event.wait(0.8) returns False after 0.8 s: polled every 0.2 s, its worker is there.
        assert c.submit(wait_on, ref, 0.8, workers=[a], pure=False).result(timeout=30) is False
        waiting = c.submit(wait_on, ref, 120, workers=[a], pure=False)
        deadline = c.submit(call_on, ref, 110, workers=[a], pure=False)
        time.sleep(1.0)
        t0 = time.monotonic()
        try:  # the worker process exits abruptly (its nanny starts a new one)
            c.run(os._exit, 1, workers=[b])
        except Exception:
            pass
        with pytest.raises(ServiceLostError, match="left the cluster"):
            waiting.result(timeout=60)
        with pytest.raises(ServiceLostError, match=r"Event\.wait: its worker"):
            deadline.result(timeout=60)  # not the whole 120 s deadline
        assert issubclass(ServiceLostError, OSError)
        assert time.monotonic() - t0 < 40


def test_plain_objects_are_called_directly():
    assert call(Sleeper(), "nap", 0.0) == 0.0


def test_flush_shards_skips_a_gone_worker_but_raises_a_live_workers_error():
    """At the end of a run the scheduler may still list a worker whose host is gone (before its
    heartbeat times out): its closed connection must not fail the run; a live worker that could
    not write its shards must."""
    from types import SimpleNamespace

    from distributed.comm.core import CommClosedError

    from rollart.runner.dask_services import DaskServices

    class Client:
        def __init__(self, answers):
            self.answers = answers

        def run(self, fn, on_error):
            assert on_error == "return"
            return self.answers

    gone = SimpleNamespace(client=Client({"a": 2, "b": CommClosedError("Address removed."),
                                          "c": 1}))
    assert DaskServices.flush_shards(gone) == 3
    broken = SimpleNamespace(client=Client({"a": 2, "b": ValueError("disk full")}))
    with pytest.raises(ValueError, match="disk full"):
        DaskServices.flush_shards(broken)


class _LostActor:
    """Like a Dask Actor whose worker was lost: every attribute it does not hold itself raises
    (a live one answers any attribute with a remote method)."""

    _cls, _address, key, _future = object, "tcp://127.0.0.1:1", "rollout-x", None

    def __getattr__(self, name):
        raise RuntimeError("Worker holding Actor was lost.  Status: error")


def test_handles_of_a_lost_actor_and_of_shards_detach_attach_and_release():
    """A restart releases the lost services' handles: that must not ask the lost actor anything
    (it raised, and the run could not restart); a ShardedRollout maps its shards' handles."""
    from rollart.handles import ActorRef, attach, detach, release
    from rollart.rollout.shards import ShardedRollout

    lost = _LostActor()
    release(lost)  # nothing to release, nothing raised
    assert detach(lost) == ActorRef(object, "tcp://127.0.0.1:1", "rollout-x")
    sharded = ShardedRollout([_LostActor(), _LostActor()])
    release(sharded)
    refs = detach(sharded)
    assert isinstance(refs, ShardedRollout) and all(isinstance(s, ActorRef) for s in refs.shards)
    assert detach([lost, 3]) == [detach(lost), 3]
    assert attach(detach(3)) == 3
