"""Losing a stateful service mid-run, through the real flow on nanny-managed Dask workers (a
killed worker comes back as a new worker of its class): the run re-creates its services and
resumes from the latest complete checkpoint within the same flow run, and the ledger of the
final checkpoint accounts for every sample exactly once.

1. `kill -9` of the trainer worker (H800);
2. `kill -9` of the CPU worker holding the rollout service (two CPU workers).
"""

import os
import threading
import time

import pytest

# A killed worker, its restart and a replacement take minutes on a busy 2-core host.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

BASE = ["rollout.num_groups=2", "rollout.group_size=4", "tasks.0.max_turns=4", "eval.episodes=0",
        "reward.backend=local", "cluster.dashboard=false", "storage.save_every=2",
        "cluster.call_timeout_s=60", "cluster.max_restarts=2", "iterations=6"]


def _holding(client, prefix: str) -> list[str]:
    actors = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors])
    return [a for a, keys in actors.items() if any(k.startswith(prefix) for k in keys)]


def _run_and_kill(prefect_api, tmp_path, run_id, workers, pick, extra=()):
    from distributed import Client

    from flows.train import train
    from infra.dask_cluster import HardwareClassCluster
    from rollart.config import load_config
    from rollart.storage.checkpointing import audit_ledger
    from rollart.storage.ledger import SampleLedger
    from rollart.storage.store import RunStore

    overrides = BASE + [f"storage.root={tmp_path}", *extra]
    store = RunStore(str(tmp_path), run_id)
    killed: list[str] = []
    with HardwareClassCluster(workers=workers, dashboard=False) as cluster, \
            Client(cluster.scheduler_address) as client:

        def kill() -> None:  # after the first complete checkpoint, while iteration 3 runs
            deadline = time.monotonic() + 1200
            while time.monotonic() < deadline and (
                    2 not in store.list_checkpoints()
                    or len(store.read_jsonl("metrics.jsonl")) < 3):
                time.sleep(0.2)
            victim = pick(client)
            killed.append(victim)
            try:  # the worker process exits abruptly (its nanny starts a fresh one)
                client.run(os._exit, 1, workers=[victim])
            except Exception:
                pass

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        out = train(config="configs/default.yaml", overrides=overrides, run_id=run_id,
                    scheduler_address=cluster.scheduler_address)
        killer.join(timeout=5)
    assert killed, "nothing was killed"
    rows = store.read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [float(i) for i in range(6)]  # each once
    files, _ = store.load_checkpoint(6, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    audit = audit_ledger(ledger, load_config("configs/default.yaml", overrides), 6)
    assert audit.ok and audit.consumed == 6 * 2 * 4, audit.as_dict()
    assert len(store.read_jsonl("resumes.jsonl")) == 1
    return out


def test_killed_trainer_worker_resumes_from_the_latest_checkpoint(prefect_api, tmp_path):
    out = _run_and_kill(prefect_api, tmp_path, "trainer-kill", {"H800": 1, "H20": 1, "CPU": 1},
                        lambda client: _holding(client, "trainer-")[0])
    [restart] = out["restarts"]
    assert restart["lost"] == "trainer" and restart["from_checkpoint"] >= 2, restart


def test_killed_rollout_service_worker_is_recreated_elsewhere(prefect_api, tmp_path):
    out = _run_and_kill(prefect_api, tmp_path, "rollout-kill", {"H800": 1, "H20": 1, "CPU": 2},
                        lambda client: _holding(client, "rollout-")[0])
    [restart] = out["restarts"]
    assert restart["lost"] == "rollout service" and restart["from_checkpoint"] >= 2, restart


def test_killed_worker_of_one_rollout_shard_restarts_the_run_from_the_checkpoint(prefect_api,
                                                                               tmp_path):
    """Two rollout shards (asyncio runner, staleness 1) on two env workers; the worker holding
    shard 1 dies: every shard is stopped, the services are created again and the run resumes
    from the latest checkpoint, each shard getting its own pending groups back; every sample id
    is accounted for once."""
    def shard_1(client):
        actors = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors])
        return next(a for a, keys in actors.items()
                    if any(k.startswith("rollout-") and k.endswith("-s1") for k in keys))

    out = _run_and_kill(prefect_api, tmp_path, "shard-kill", {"H800": 1, "H20": 1, "CPU": 2},
                        shard_1, extra=["rollout.shards=2", "rollout.runner=asyncio",
                                        "rollout.batching=continuous", "rollout.max_staleness=1"])
    [restart] = out["restarts"]
    assert restart["lost"] == "rollout service" and restart["from_checkpoint"] >= 2, restart
