"""The engines build while the trainer does (`DaskServices.begin`), on real Dask actors: two
in-process workers of different classes, services that take a while to build."""

from __future__ import annotations

import time
from typing import Any

import pytest
from distributed import Client, Scheduler, SpecCluster, Worker, get_worker

from rollart.config import load_config
from rollart.handles import call
from rollart.run import RunSpec
from rollart.runner import dask_services
from rollart.runner.dask_services import DaskServices
from rollart.runner.driver import Placement

BUILD_S = 0.5  # each fake service's build time: long against the actor round trips
EVENTS: list[tuple[str, str, float]] = []  # (service, "start" | "end", monotonic time)


class _Slow:
    def __init__(self, name: str) -> None:
        EVENTS.append((name, "start", time.monotonic()))
        time.sleep(BUILD_S)  # a model load, an engine start-up
        self.address = get_worker().address
        EVENTS.append((name, "end", time.monotonic()))

    def where(self) -> dict[str, Any]:
        return {"worker": self.address, "address": self.address}


class FakeTrainer(_Slow):
    def __init__(self, run: RunSpec) -> None:
        super().__init__("trainer")


class FakeEngine(_Slow):
    def __init__(self, run: RunSpec, replica: int) -> None:
        super().__init__(f"engine-{replica}")


class FakeEnvHost:
    def __init__(self, run: RunSpec) -> None:
        self.address = get_worker().address

    def stats(self) -> dict[str, Any]:
        return {"address": self.address}


class FakeRollout:
    def __init__(self, run: RunSpec, engines: Any, hosts: Any, version: int) -> None:
        self.address = get_worker().address

    def where(self) -> dict[str, Any]:
        return {"address": self.address}


def _at(name: str, what: str) -> float:
    return next(t for n, w, t in EVENTS if n == name and w == what)


@pytest.fixture
def services(monkeypatch: pytest.MonkeyPatch):
    """`DaskServices` over a cluster with the given workers (name -> resources)."""
    monkeypatch.setattr(dask_services, "TrainerService", FakeTrainer)
    monkeypatch.setattr(dask_services, "EngineService", FakeEngine)
    monkeypatch.setattr(dask_services, "EnvHostService", FakeEnvHost)
    monkeypatch.setattr(dask_services, "RolloutServiceActor", FakeRollout)
    EVENTS.clear()
    opened = []

    def make(workers: dict[str, dict[str, float]]) -> DaskServices:
        spec = {n: {"cls": Worker, "options": {"nthreads": 2, "resources": r}}
                for n, r in workers.items()}
        cluster = SpecCluster(workers=spec, scheduler={
            "cls": Scheduler, "options": {"dashboard_address": ":0"}})
        client = Client(cluster)
        opened.extend([client, cluster])
        client.wait_for_workers(len(workers))
        run = RunSpec(load_config("configs/default.yaml"), "build-ahead")
        return DaskServices(client, run, Placement())

    yield make
    for x in opened:
        x.close()


def test_engines_build_while_the_trainer_does_on_their_own_workers(services):
    """Submitted first, built side by side; after a restart, begun again under new keys."""
    svc = services({"gpu-a": {"H800": 1, "CPU": 1}, "gpu-b": {"H20": 1}})
    svc.begin()
    trainer = svc.trainer()
    (engine,) = svc.engines()
    assert _at("engine-0", "start") < _at("trainer", "end")  # built side by side
    assert call_where(trainer) != call_where(engine)  # each on its class's worker
    assert svc.ahead == []  # handed out once
    assert [p["worker"] for p in svc.placed.by_stage["engine_service"]] == [call_where(engine)]
    # A restart (lost services) drops what was begun for the attempt before: new keys.
    svc.begin()
    begun = svc.ahead[0].key
    svc.restart()
    assert svc.ahead == []
    svc.begin()
    assert svc.ahead[0].key != begun and svc.ahead[0].key.endswith("-1-0")  # attempt 1


def test_one_worker_of_both_classes_builds_the_trainer_first(services):
    """A process that would hold both builds them one after the other, as without `begin`."""
    svc = services({"gpu": {"H800": 1, "H20": 1, "CPU": 1}})
    svc.begin()
    assert svc.ahead == []
    svc.trainer()
    svc.engines()
    assert _at("engine-0", "start") >= _at("trainer", "end")


@pytest.mark.timeout(60)  # before the fix this waited forever on the departed worker
def test_env_hosts_skip_a_worker_that_left_after_the_class_was_read(services):
    """The env pool scales down while the trainer and engines load: a host pinned to a
    departed worker would wait forever. It goes on the workers still there, and the rollout
    service goes with the hosts, not on the class's workers as first read."""
    svc = services({"gpu": {"H800": 1, "H20": 1}, "cpu-a": {"CPU": 1}, "cpu-b": {"CPU": 1}})
    first, second = sorted(svc.classes["CPU"])
    svc.client.retire_workers([first])
    hosts = svc.env_hosts()
    assert [call(h).stats()["address"] for h in hosts] == [second]
    assert call(svc.rollout([], hosts, 0)).where()["address"] == second


def call_where(actor: Any) -> str:
    from rollart.handles import call

    return call(actor).where()["address"]
