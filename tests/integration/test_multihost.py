"""Several hosts for real on one machine: network namespaces made here (infra/netns.py: veth
pairs on a private bridge, their own addresses; removed at the end, also on failure). The Dask
scheduler runs on one host, the S3 store (SeaweedFS) on another, the trainer class (H800) on a
third, the engine class (H20) on a fourth, the env class (CPU) on a fifth; the run's flow (this
process) reaches them over the bridge. Nothing is on loopback: a component that assumed one box
would fail. The trainer's weights reach the engine's host as a stream between the two (never
through the flow process)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _wait_workers(address: str, want: dict[str, int], timeout: float = 180.0) -> dict:
    from distributed import Client

    from rollart.config.hardware import worker_classes

    with Client(address, timeout=60) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            have = worker_classes(client)
            if all(len(have.get(c, [])) >= n for c, n in want.items()):
                return {w["name"]: w["host"] for w in
                        client.scheduler_info(n_workers=-1)["workers"].values()}
            time.sleep(0.5)
    raise AssertionError(f"workers of {want} did not join; have {have}")


@contextlib.contextmanager
def namespace_cluster(tmp_path, monkeypatch, env_hosts: list[str],
                      worker_ttl: str | None = None):
    """Hosts sched, store, gpu, gpu2 and `env_hosts`; the scheduler, S3, an H800 worker on gpu,
    an H20 worker on gpu2, one CPU worker per env host (named CPU-0, CPU-1, ... in that order).
    `worker_ttl`: how long the scheduler waits for a silent worker's heartbeat before it
    counts it dead."""
    from infra.dask_cluster import WORKER_ENVIRON
    from infra.netns import NetnsHosts
    from infra.seaweed import start_seaweed

    logs = tmp_path / "logs"
    logs.mkdir()
    with NetnsHosts(["sched", "store", "gpu", "gpu2", *env_hosts]) as net:
        s3 = start_seaweed(tmp_path / "s3", host=net.addr("store"),
                           launcher=["ip", "netns", "exec", net.hosts["store"].netns])
        try:
            for k, v in s3.env().items():
                monkeypatch.setenv(k, v)  # the flow (here) and, inherited, the workers
            env = {**os.environ, "PYTHONPATH": str(ROOT),
                   **{k: str(v) for k, v in WORKER_ENVIRON.items() if v is not None}}
            if worker_ttl:
                env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"] = worker_ttl
            py = sys.executable

            def start(host: str, argv: list[str], log: str) -> None:
                net.popen(host, argv, cwd=ROOT, env=env, stdout=open(logs / log, "wb"),
                          stderr=subprocess.STDOUT)

            sched = f"tcp://{net.addr('sched')}:8786"
            start("sched", [py, "-m", "distributed.cli.dask_scheduler", "--host",
                            net.addr("sched"), "--port", "8786", "--no-dashboard"], "sched.log")

            def worker(host: str, hw: str, name: str) -> None:
                start(host, [py, "-m", "distributed.cli.dask_worker", sched, "--host",
                             net.addr(host), "--name", name, "--nthreads", "1", "--resources",
                             f"{hw}=1", "--memory-limit", "0", "--no-dashboard"], f"{name}.log")

            worker("gpu", "H800", "H800-0")
            worker("gpu2", "H20", "H20-0")
            for i, host in enumerate(env_hosts):
                worker(host, "CPU", f"CPU-{i}")
                # One at a time: the first env worker (it will hold the rollout service) is
                # the one on the first env host.
                _wait_workers(sched, {"CPU": i + 1})
            where = _wait_workers(sched, {"H800": 1, "H20": 1, "CPU": len(env_hosts)})
            yield net, sched, s3, where
        finally:
            s3.stop(kill=True)
    assert not net.leftovers(), net.leftovers()


def test_a_host_removed_mid_run(prefect_api, tmp_path, monkeypatch):
    """Scheduler, S3, the GPU classes and two env hosts each in their own network namespace;
    every stage runs on its class's host. The second env host drops off the network (link
    down, then every process on it killed, as a dead machine) after the first iteration; the
    run finishes on the other env host."""
    import s3fs

    from flows.train import train

    # A host that vanishes sends no FIN: the scheduler learns it from missing heartbeats (Dask
    # waits 5 minutes by default; 10 s was too short for workers on this loaded 2-core box).
    with namespace_cluster(tmp_path, monkeypatch, ["env", "env2"], worker_ttl="30s") as (
            net, sched, s3, where):
        assert where["CPU-1"] == net.addr("env2")
        # Our own uncached view of the store: the flow's s3fs instance (same process) caches
        # listings, so a miss seen there before the file existed would stick.
        fs = s3fs.S3FileSystem(key=s3.access_key, secret=s3.secret_key,
                               endpoint_url=s3.endpoint_url, use_listings_cache=False,
                               skip_instance_cache=True)
        metrics = f"{s3.bucket}/lost/runs/netns-lost/metrics.jsonl"
        removed: list[float] = []

        def remove_env2() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not fs.exists(metrics):
                time.sleep(0.5)
            net.remove("env2")
            removed.append(time.monotonic())

        remover = threading.Thread(target=remove_env2, daemon=True)
        remover.start()
        out = train(config="configs/default.yaml", run_id="netns-lost", overrides=[
            f"cluster.address={sched}", "iterations=4", "rollout.num_groups=2",
            "rollout.group_size=4", "eval.episodes=4", "eval.every=0", "storage.save_every=4",
            "tasks.0.max_turns=3", "reward.backend=local", "rollout.env_timeout_s=5",
            "tasks.0.latency={median_s: 0.05}", *s3.overrides("lost"),
            # The namespace hosts share this machine's /dev/shm: the trainer's shared file
            # would reach gpu2 too, which a real second machine's engine could not map.
            "engine.shared_memory_sync=false"])
        remover.join(timeout=5)
        # Each worker lives at its host's own address (not loopback, not the test's bridge),
        # and every stage ran on the worker of its class, on that class's host.
        assert where == {"H800-0": net.addr("gpu"), "H20-0": net.addr("gpu2"),
                         "CPU-0": net.addr("env"), "CPU-1": net.addr("env2")}, where
        for stage, (hw, hosts) in {"collect": ("CPU", ("env", "env2")),
                                   "update": ("H800", ("gpu",)),
                                   "sync_weights": ("H20", ("gpu2",)),
                                   "trainer_service": ("H800", ("gpu",)),
                                   "engine_service": ("H20", ("gpu2",))}.items():
            for rec in out["placement"][stage]:
                assert rec["worker"].startswith(f"{hw}-") and where[rec["worker"]] in [
                    net.addr(h) for h in hosts], (stage, rec)
        assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"])
        assert removed, "env2 was never removed"
        assert not net.pids("env2")
        rows = [json.loads(line) for line in fs.cat(metrics).decode().splitlines() if line]
    assert [r["iteration"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    # Every sync streamed the weights from the trainer's host to the engine's (no shared file
    # across hosts, nothing through the flow).
    synced = [r for r in rows if "perf/sync_s" in r]
    assert synced and all(r["perf/sync_stream_engines"] == 1.0 and
                          r["perf/sync_shm_engines"] == 0.0 for r in synced), [
        (r.get("perf/sync_stream_engines"), r.get("perf/sync_shm_engines")) for r in synced]
    counters = out["rollout"]["counters"]
    assert counters.get("hosts_lost") == 1, out["rollout"]["recent_errors"]
    assert out["rollout"]["hosts_alive"] == [True, False]
    # Its episodes failed (a call into a black hole: env_timeout_s, then a probe) and were
    # re-issued on the host that is left.
    assert counters.get("retried", 0) >= 1, counters
