"""Kill training while a checkpoint upload is in flight, resume, and restart S3 mid-run.

1. Training runs in a subprocess (the in-process loop of rollart/runner/local_loop.py: the same
   stage functions, TrainerService, Checkpointer and store as the flow, without Prefect and Dask
   start-up cost) against a real `weed mini`, with a test hook that sleeps 4 s between the files
   of checkpoint 2. As soon as checkpoint 2 has a file but no manifest it is SIGKILLed.
2. The run is resumed through the flow parameter (`train(resume=run_id)`, what
   `rollart train --resume` calls). After its first iteration the S3 server is SIGKILLed and
   brought back 3 s later; the run must complete on retries.
3. Checks: checkpoint 1 (the previous complete one) was used, the torn one rolled back, the
   final ledger holds every planned sample id exactly once, metrics have each iteration once,
   and the engines serve the trainer's weights.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from infra.seaweed import start_seaweed

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
KEY, SECRET = "rollart-resume", "rollart-resume-secret"
RUN = ["iterations=3", "storage.save_every=1", "storage.keep_last=3", "rollout.num_groups=2",
       "rollout.group_size=2", "tasks.0.max_turns=2", "eval.episodes=0",
       "reward.backend=local", "cluster.dashboard=false"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"), access_key=KEY, secret_key=SECRET)
    yield server
    server.stop()


def _env(s3, prefect_api: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLART_FAULT"))}
    env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, PREFECT_API_URL=prefect_api,
               **extra)
    return env


KILLED_RUN = """
import sys
from rollart.config import load_config
from rollart.runner.local_loop import run_local
if __name__ == "__main__":
    run_local(load_config(sys.argv[1], sys.argv[3:]), sys.argv[2])
"""


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def test_kill_mid_checkpoint_then_resume_through_an_s3_restart(s3, prefect_api, monkeypatch,
                                                               tmp_path):
    from rollart.config import load_config
    from rollart.rollout.plan import plan_iteration
    from rollart.storage.ledger import SampleLedger
    from rollart.storage.store import RunStore

    run_id = "resume-itest"
    location = s3.overrides("resume")
    cfg = load_config(REPO / "configs/default.yaml", [*location, *RUN])
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = RunStore.from_config(cfg.storage, run_id)

    # 1. Train in a subprocess; SIGKILL it while checkpoint 2 is being uploaded.
    log = open(tmp_path / "killed-run.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(REPO / "configs/default.yaml"), run_id, *location,
         *RUN], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=_env(s3, prefect_api, ROLLART_FAULT_SLOW_CHECKPOINT="2:4"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "checkpoint 2 never started uploading"
            names = store.listdir("checkpoints/00000002")
            if names and "manifest.json" not in names:
                break
            time.sleep(0.2)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert store.list_checkpoints() == [1] and 2 in store.checkpoint_steps()

    # 2. Resume (flow parameter); crash S3 after the first resumed iteration, back 3 s later.
    from flows.train import train
    from rollart.runner import progress

    bounce: dict[str, float] = {}

    def crash_s3_once(row):
        if not bounce:
            bounce["at_iteration"] = float(row["iter"])
            s3.stop(kill=True)
            bounce["down"] = time.monotonic()

            def back():
                time.sleep(3.0)
                s3.start()
                bounce["up"] = time.monotonic()

            threading.Thread(target=back, daemon=True).start()

    progress.install(crash_s3_once)
    try:
        out = train(config=str(REPO / "configs/default.yaml"), overrides=location, resume=run_id)
    finally:
        progress.clear()
        if not s3.alive():
            s3.start()
    assert out["resumed_from"] == 1 and bounce["at_iteration"] == 1  # iterations 1, 2 re-run
    assert bounce["up"] - bounce["down"] >= 3.0  # the outage happened while the run went on

    # 3. The previous complete checkpoint was used; the torn one was rolled back.
    resumes = store.read_jsonl("resumes.jsonl")
    assert [(r["step"], r["next_iteration"]) for r in resumes] == [(1, 1)]
    assert resumes[0]["abandoned"]["torn_checkpoints"] == [2]
    assert store.list_checkpoints() == [1, 2, 3]
    manifest = store.read_manifest(3)
    assert manifest["train_step"] == 3 and manifest["version"] == 3
    assert out["checkpoint"] == f"{store.url}/checkpoints/00000003"

    # The ledger: every planned sample id exactly once, consumed by the update of its iteration.
    files, _ = store.load_checkpoint(3, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    planned = {s.sample_id: i for i in range(3) for s in plan_iteration(cfg, i)}
    counts = Counter(ledger.ids())
    assert set(counts) == set(planned), "gap or stranger in the ledger"
    assert max(counts.values()) == 1, "a sample appears twice"
    assert {r[0]: r[3] for r in ledger.records} == {s: i + 1 for s, i in planned.items()}
    assert manifest["ledger"]["ok"] and ledger.next_iteration == 3

    rows = store.read_jsonl("metrics.jsonl")
    assert sorted(r["iteration"] for r in rows) == [0.0, 1.0, 2.0]
    assert {t.sample_id for t in store.read_shards()} <= set(planned)
    assert out["fingerprints"]["engine"] == pytest.approx(out["fingerprints"]["trainer"])


def test_wrong_credentials_fail_at_flow_start_in_one_line(s3, prefect_api, monkeypatch):
    """What `rollart train` prints as `Run failed: <message>`: one line, before any cluster."""
    from prefect.exceptions import FailedRun

    import flows.train

    def no_cluster(*a, **k):
        raise AssertionError("a Dask cluster was started despite wrong credentials")

    monkeypatch.setattr(flows.train, "open_cluster", no_cluster)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    t0 = time.monotonic()
    state = flows.train.train(config=str(REPO / "configs/default.yaml"),
                              overrides=[*s3.overrides("badcreds"), *RUN], return_state=True)
    assert state.is_failed() and time.monotonic() - t0 < 30
    assert state.message.startswith("storage: S3 rejected the credentials for s3://rollart/")
    assert "AWS_SECRET_ACCESS_KEY" in state.message and "\n" not in state.message
    with pytest.raises(FailedRun, match="rejected the credentials"):
        state.result()
