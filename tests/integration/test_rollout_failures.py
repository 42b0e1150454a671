"""Failure isolation through the real flow: Dask workers by class, env hosts, a Prefect server.

1. 10 % of env steps raise and one env step hangs (past `rollout.env_timeout_s`): the run
   completes every iteration and the service's counters equal what the env hosts injected.
2. An env-class worker dies mid-run: its episodes fail and are re-issued on the other env host;
   the run completes.
"""

import os
import threading
import time

import pytest

pytestmark = pytest.mark.integration

BASE = ["rollout.num_groups=2", "rollout.group_size=4", "tasks.0.max_turns=4", "eval.episodes=0",
        "reward.backend=local", "cluster.dashboard=false", "storage.save_every=100"]


def test_injected_step_errors_and_a_hang_cost_only_their_episodes(prefect_api, tmp_path):
    from flows.train import train
    from rollart.storage.store import RunStore

    overrides = BASE + [
        "iterations=4", f"storage.root={tmp_path}", "rollout.env_timeout_s=3",
        "rollout.max_retries=3",
        "tasks.0.faults={step_error_rate: 0.1, hang_at_step: 5, hang_s: 20}",
    ]
    t0 = time.monotonic()
    out = train(config="configs/default.yaml", overrides=overrides, run_id="faults")
    rows = RunStore(str(tmp_path), "faults").read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0.0, 1.0, 2.0, 3.0]  # every iteration completed

    counters = out["rollout"]["counters"]
    injected = out["rollout"]["env_hosts"][0]["injected"]["frozenlake"]
    assert injected.get("errors", 0) >= 3, injected  # ~10 % of ~100 steps
    assert injected["hangs"] == 1
    assert counters.get("failed", 0) == injected["errors"], out["rollout"]["recent_errors"]
    assert counters.get("timeouts", 0) == 1, counters
    # Every failure is re-issued, except one that spends a group's retry budget (rare here).
    assert (counters["retried"] + counters.get("groups_dropped_failures", 0)
            == counters["failed"] + counters["timeouts"]), counters
    assert rows[-1]["rollout/failed_total"] == counters["failed"]
    assert sum(r["rollout/failed"] for r in rows) == counters["failed"]  # per iteration
    assert rows[-1]["rollout/timeouts"] == 1
    # The hang cost its own episode's timeout, not the run: it never waited out hang_s per call.
    assert time.monotonic() - t0 < 120


def test_lost_env_worker_costs_only_its_episodes(prefect_api, tmp_path):
    from distributed import Client

    from flows.train import train
    from infra.dask_cluster import HardwareClassCluster, worker_classes
    from rollart.storage.store import RunStore

    overrides = BASE + [
        "iterations=4", f"storage.root={tmp_path}", "rollout.env_timeout_s=5",
        "tasks.0.latency={median_s: 0.05}",
    ]
    store = RunStore(str(tmp_path), "lost")
    workers = {"H800": 1, "H20": 1, "CPU": 2}
    with HardwareClassCluster(workers=workers, dashboard=False) as cluster, \
            Client(cluster.scheduler_address) as client:
        killed: list[str] = []

        def kill_an_env_worker() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not store.exists("metrics.jsonl"):
                time.sleep(0.2)
            actors = client.run(lambda dask_worker: list(dask_worker.state.actors))
            for addr in worker_classes(client)["CPU"]:
                if not any(str(k).startswith("rollout-") for k in actors.get(addr, [])):
                    killed.append(addr)
                    try:  # the worker process exits abruptly (its nanny starts a fresh one)
                        client.run(os._exit, 1, workers=[addr])
                    except Exception:
                        pass
                    return

        killer = threading.Thread(target=kill_an_env_worker, daemon=True)
        killer.start()
        out = train(config="configs/default.yaml", overrides=overrides, run_id="lost",
                    scheduler_address=cluster.scheduler_address)
        killer.join(timeout=5)
    assert killed, "no env worker was killed"
    rows = store.read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    counters = out["rollout"]["counters"]
    assert counters.get("hosts_lost") == 1, out["rollout"]["recent_errors"]
    assert counters.get("failed", 0) >= 1 and counters["retried"] >= 1, counters
    assert out["rollout"]["hosts_alive"].count(True) == 1
