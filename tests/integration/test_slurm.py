"""`cluster.manager: slurm` against a real single-node Slurm (slurm-wlm + munge, started and
stopped here; installed with apt when missing, never skipped): workers of three hardware classes
as Slurm jobs on one scheduler, the env pool adaptive between bounds, and a short training run
through the Prefect flow on those workers."""

from __future__ import annotations

import os
import time

import pytest
from slurm_node import SlurmNode  # tests/integration (pytest puts it on sys.path)

pytestmark = pytest.mark.integration

# Small jobs: the node declares 8 CPUs / 20 GB (more than the box has, on purpose: DESIGN.md).
CLASSES = ("cluster.slurm.classes={H800: {memory: 3GB, directives: ['--constraint=h800']}, "
           "H20: {memory: 3GB, directives: ['--constraint=h20']}, CPU: {memory: 2GB}}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    node = SlurmNode()
    try:
        env = node.start()
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # sbatch/squeue/scancel of this process talk to this instance
        yield node
    finally:
        try:
            node.stop()
        finally:
            for k, v in locals().get("old", {}).items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _cfg(tmp_path, *extra):
    from rollart.config import load_config

    return load_config("configs/default.yaml", [
        "cluster.manager=slurm", CLASSES, f"cluster.slurm.log_directory={tmp_path / 'jobs'}",
        "cluster.dashboard=false", *extra])


def test_three_classes_as_slurm_jobs_and_adaptive_env_pool(slurm, tmp_path):
    from distributed import Client

    from infra.slurm import SlurmClassCluster

    cfg = _cfg(tmp_path, "cluster.slurm.adapt={minimum: 1, maximum: 3, interval_s: 0.5, "
               "wait_count: 2, target_duration_s: 1.0}")
    t0 = time.monotonic()
    with SlurmClassCluster(cfg.cluster) as cluster, Client(cluster.scheduler_address) as client:
        joined_s = time.monotonic() - t0
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        by_name = {w["name"]: set(w["resources"]) for w in info}
        assert by_name == {"H800-0": {"H800"}, "H20-0": {"H20"}, "CPU-0": {"CPU"}}, by_name
        # Each worker is its own Slurm job, and the class's directives reached Slurm.
        jobs = {j["id"]: j for j in slurm.jobs()}
        ids = cluster.job_ids()
        assert set(ids) == {"H800-0", "H20-0", "CPU-0"}
        assert {jobs[ids[n]]["state"] for n in ids} == {"RUNNING"}
        assert jobs[ids["H800-0"]]["features"] == "h800"
        assert jobs[ids["H20-0"]]["features"] == "h20"
        assert all(jobs[i]["name"] == f"rollart-{n.split('-')[0]}" for n, i in ids.items())

        # A service (actor) on the first env worker: scale-down must never take it.
        # By its package path: the workers import it from the checkout (their cwd), by reference.
        from tests.integration.slurm_helpers import Counter, busy

        counter = client.submit(Counter, actor=True, resources={"CPU": 1}).result()
        assert counter.incr().result() == 1
        # Queued env-class work beyond target_duration_s per worker: the pool grows by
        # submitting Slurm jobs, up to the maximum.
        futs = client.map(busy, [1.5] * 24, resources={"CPU": 1}, pure=False)
        deadline = time.monotonic() + 120
        while cluster.class_counts().get("CPU", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.class_counts().get("CPU", 0) == 3, slurm.jobs()
        assert sum(1 for j in slurm.jobs() if j["name"] == "rollart-CPU") == 3
        # A second service on the newest env worker, the first one scale-down would pick.
        newest = {w["name"]: a for a, w in
                  client.scheduler_info(n_workers=-1)["workers"].items()}["CPU-2"]
        late = client.submit(Counter, actor=True, workers=[newest]).result()
        assert sum(client.gather(futs)) == 24 * 1.5
        # Idle again: the pool shrinks towards the minimum (1) but keeps both workers that hold
        # a service: CPU-1 goes, CPU-0 and CPU-2 stay.
        deadline = time.monotonic() + 120
        while cluster.class_counts().get("CPU", 0) > 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(4 * cfg.cluster.slurm.adapt.interval_s * cfg.cluster.slurm.adapt.wait_count)
        names = {w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        assert names == {"H800-0", "H20-0", "CPU-0", "CPU-2"}, names
        assert counter.incr().result() == 2 and late.incr().result() == 1  # both survived
        assert sum(1 for j in slurm.jobs() if j["name"] == "rollart-CPU") == 2
        # The GPU classes were never touched by the env pool's scaling.
        assert {n for n in cluster.job_ids() if not n.startswith("CPU")} == {"H800-0", "H20-0"}
    # Everything the cluster started is gone from Slurm once it closes.
    deadline = time.monotonic() + 30
    while [j for j in slurm.jobs() if j["state"] in ("RUNNING", "PENDING")] and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [j for j in slurm.jobs() if j["state"] in ("RUNNING", "PENDING")]
    print(f"slurm: three classes joined in {joined_s:.1f} s")


def test_slurm_problems_name_the_class(slurm, tmp_path):
    from infra.slurm import SlurmClassCluster

    # A job Slurm accepts but cannot start yet: the run waits join_timeout_s, then fails
    # naming the missing class and what squeue says about its job.
    cfg = _cfg(tmp_path, "cluster.slurm.classes.H20.directives=['--begin=now+1hour']",
               "cluster.slurm.join_timeout_s=8", "cluster.slurm.adapt=null")
    with pytest.raises(RuntimeError) as err:
        with SlurmClassCluster(cfg.cluster):
            pass
    assert "missing {'H20': 1}" in str(err.value)
    assert "rollart-H20 PENDING BeginTime" in str(err.value)
    # A job Slurm refuses (no node has the feature): fails at once, naming the class.
    cfg = _cfg(tmp_path, "cluster.slurm.classes.H20.directives=['--constraint=b200']")
    with pytest.raises(RuntimeError, match=r"Slurm refused the H20 worker job \(sbatch: error: "
                       r"Batch job submission failed: Invalid feature"):
        with SlurmClassCluster(cfg.cluster):
            pass
    time.sleep(1)  # both clusters cancelled what they had submitted
    assert not [j for j in slurm.jobs() if j["state"] in ("RUNNING", "PENDING")], slurm.jobs()


def test_training_run_on_slurm_workers(slurm, prefect_api, tmp_path):
    from flows.train import train
    from rollart.storage.store import RunStore

    out = train(config="configs/default.yaml", run_id="slurm-itest", overrides=[
        "cluster.manager=slurm", CLASSES, f"cluster.slurm.log_directory={tmp_path / 'jobs'}",
        "cluster.dashboard=false", "iterations=2", "rollout.num_groups=2",
        "rollout.group_size=4", "eval.episodes=4", "eval.every=0", "storage.save_every=2",
        f"storage.root={tmp_path / 'store'}", "tasks.0.max_turns=3",
    ])
    store = RunStore(str(tmp_path / "store"), "slurm-itest")
    assert store.latest_checkpoint() == 2
    assert len(store.read_jsonl("metrics.jsonl")) == 2
    # Every stage ran on a Slurm-started worker of its class (names the manager gave them):
    # the fixed classes' one worker; any of the adaptive env pool's, which may have grown while
    # the trainer and engines loaded and shrunk again (even past the worker it started with).
    for stage, hw in {"collect": "CPU", "update": "H800", "sync_weights": "H20",
                      "trainer_service": "H800", "engine_service": "H20"}.items():
        for rec in out["placement"][stage]:
            name = rec["worker"]
            assert hw in rec["resources"], (stage, rec)
            assert name.startswith(f"{hw}-") if hw == "CPU" else name == f"{hw}-0", (stage, rec)
    assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"])
