"""Engine replica loss through the real flow: two engine replicas on two real Dask workers of the
engine class (nanny-managed). A killed worker (the process exits abruptly; its nanny starts a
fresh one): the replica is failed over (its turns re-issued on the other one) and a sync goes on
without it. A hung worker: SIGSTOP for longer than the call deadline, then SIGCONT: the replica
is failed over, then probed back into rotation. Either way the run completes and the ledger
accounts for every sample exactly once.
"""

import os
import signal
import threading
import time

import pytest

# A killed worker, its restart and a replacement take minutes on a busy 2-core host. The call
# deadline is 60 s: a policy update took ~34 s on this 2-core host shared with a benchmark,
# and a 30 s deadline there made a slow trainer look lost.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

BASE = ["rollout.num_groups=2", "rollout.group_size=4", "tasks.0.max_turns=4", "eval.episodes=4",
        "eval.every=3", "reward.backend=local", "cluster.dashboard=false",
        "storage.save_every=100", "engine.replicas=2", "cluster.call_timeout_s=60",
        "rollout.engine_wait_timeout_s=120"]
WORKERS = {"H800": 1, "H20": 2, "CPU": 1}


def _engine_workers(client) -> list[str]:
    actors = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors])
    return [a for a, keys in actors.items() if any(k.startswith("engine-") for k in keys)]


def _after_first_row(store, deadline_s: float = 1200) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not store.exists("metrics.jsonl"):
        time.sleep(0.2)


def _ledger_audit(store, cfg_overrides, iterations):
    from rollart.config import load_config
    from rollart.storage.checkpointing import audit_ledger
    from rollart.storage.ledger import SampleLedger

    cfg = load_config("configs/default.yaml", cfg_overrides)
    files, _ = store.load_checkpoint(iterations, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    return ledger, audit_ledger(ledger, cfg, iterations)


def _train_with(prefect_api, tmp_path, run_id, fault, iterations=6):
    from distributed import Client

    from flows.train import train
    from infra.dask_cluster import HardwareClassCluster
    from rollart.storage.store import RunStore

    overrides = BASE + [f"iterations={iterations}", f"storage.root={tmp_path}"]
    store = RunStore(str(tmp_path), run_id)
    with HardwareClassCluster(workers=WORKERS, dashboard=False) as cluster, \
            Client(cluster.scheduler_address) as client:
        done: dict = {}
        injector = threading.Thread(target=fault, args=(client, store, done), daemon=True)
        injector.start()
        out = train(config="configs/default.yaml", overrides=overrides, run_id=run_id,
                    scheduler_address=cluster.scheduler_address)
        injector.join(timeout=30)
    rows = store.read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [float(i) for i in range(iterations)]
    ledger, audit = _ledger_audit(store, overrides, iterations)
    assert audit.ok, audit.as_dict()
    assert audit.consumed == iterations * 2 * 4 and audit.dropped == 0  # none lost to the fault
    return out, rows, done


def test_hung_engine_worker_is_failed_over_then_probed_back(prefect_api, tmp_path):
    def hang(client, store, done):
        _after_first_row(store)
        victim = _engine_workers(client)[-1]
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGSTOP)  # longer than cluster.call_timeout_s (60 s)
        done["stopped"] = time.monotonic()
        time.sleep(75)
        os.kill(pid, signal.SIGCONT)

    out, rows, done = _train_with(prefect_api, tmp_path, "engine-hang", hang)
    assert done.get("stopped"), "no engine worker was stopped"
    counters = out["rollout"]["counters"]
    assert counters.get("engines_lost") == 1, out["rollout"]["recent_errors"]
    assert any("did not answer within 60s" in e for e in out["rollout"]["recent_errors"])
    revived = out["rollout"]["engines_revived"]
    assert [e["how"] for e in revived] == ["probe"], revived  # the same actor, back
    assert out["rollout"]["engines_alive"] == [True, True]


def test_killed_engine_worker_fails_over_and_is_replaced(prefect_api, tmp_path):
    def kill(client, store, done):
        _after_first_row(store)
        victim = _engine_workers(client)[0]
        done["victim"] = victim
        try:  # the worker process exits abruptly (its nanny starts a fresh one)
            client.run(os._exit, 1, workers=[victim])
        except Exception:
            pass

    out, rows, done = _train_with(prefect_api, tmp_path, "engine-kill", kill)
    assert done.get("victim"), "no engine worker was killed"
    counters = out["rollout"]["counters"]
    print("engine kill:", counters, out["rollout"]["engines_revived"])  # shown with -s
    assert counters.get("engines_lost") == 1, out["rollout"]["recent_errors"]
    assert "failed" not in counters and "engine_errors" not in counters  # no episode paid
    assert sum(r["perf/sync_skipped"] for r in rows) >= 1  # a sync went on without it
    # The replacement on the restarted worker: once it is built (seconds on an idle host,
    # minutes on a loaded one), the supervisor puts it in rotation with the current weights;
    # whether that happens before this short run ends depends on the host, so it is checked
    # in one process (tests/unit/test_engine_failover.py) and reported, not asserted, here.
    for e in out["rollout"]["engines_revived"]:
        assert e["how"] == "replacement" and out["rollout"]["engines_alive"] == [True, True]
