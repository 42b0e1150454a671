"""Storage integrity (issue 15, item 6): one writer per run id, CRC-verified restore with
fallback to the previous checkpoint, a torn metrics line on resume.

Real components: training runs are the in-process loop (`run_local`: the stage functions,
TrainerService, Checkpointer and store of the flow), one of them in a subprocess that is
SIGKILLed; the local store on disk; SeaweedFS (`weed mini`) for the object-store lock; the
Prefect flow `train` for the refusal a user sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.seaweed import start_seaweed
from rollart.config import load_config
from rollart.rollout.plan import plan_iteration
from rollart.runner.local_loop import run_local
from rollart.storage.ledger import SampleLedger
from rollart.storage.lock import RunLock, RunLockedError, run_lock
from rollart.storage.resume import ResumeError, start_run
from rollart.storage.store import RunStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
CONFIG = str(REPO / "configs/default.yaml")
RUN = ["storage.save_every=1", "storage.keep_last=5", "rollout.num_groups=2",
       "rollout.group_size=2", "tasks.0.max_turns=2", "eval.episodes=0", "reward.backend=local",
       "cluster.dashboard=false"]
KEY, SECRET = "rollart-lock", "rollart-lock-secret"
LIVE_RUN = """
import sys
from rollart.config import load_config
from rollart.runner.local_loop import run_local
if __name__ == "__main__":
    run_local(load_config(sys.argv[1], sys.argv[3:]), sys.argv[2])
"""


@contextlib.contextmanager
def _storage_warnings():
    """Warnings of rollart.storage, caught on that logger itself: Prefect's logging set-up
    (another test's flow run in this session) may stop them reaching pytest's caplog."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("rollart.storage")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _files(root: Path) -> set[str]:
    """Files under root, without the live run's in-flight temporaries (renamed when done)."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if ".tmp-" not in p.name}


def _ledger_ok(store: RunStore, step: int, cfg, iterations: int) -> None:
    files, manifest = store.load_checkpoint(step, only=["ledger.json"])
    ledger = SampleLedger.from_json(files["ledger.json"])
    planned = [s.sample_id for i in range(iterations) for s in plan_iteration(cfg, i)]
    assert sorted(ledger.ids()) == sorted(planned) and manifest["ledger"]["ok"]


def test_second_writer_refused_then_resume_after_kill_with_a_torn_metrics_line(tmp_path):
    run_id = "live"
    overrides = [f"storage.root={tmp_path}", *RUN, "iterations=3"]
    cfg = load_config(CONFIG, overrides)
    store = RunStore(str(tmp_path), run_id)
    log = open(tmp_path / "live.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLART_FAULT")}
    # Checkpoint 2's upload sleeps 2 s after each file: the run is alive and writing while we
    # try to join it.
    proc = subprocess.Popen([sys.executable, "-c", LIVE_RUN, CONFIG, run_id, *overrides],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            env={**env, "ROLLART_FAULT_SLOW_CHECKPOINT": "2:2"})
    try:
        deadline = time.monotonic() + 120
        while not (store.listdir("checkpoints/00000002")
                   and store.list_checkpoints() == [1]):
            assert proc.poll() is None, (tmp_path / "live.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "checkpoint 2 never started uploading"
            time.sleep(0.1)
        before = _files(tmp_path)
        # A second writer, both ways a run starts: the flow's start_run and the in-process loop.
        t0 = time.monotonic()
        holder = rf"host {socket.gethostname()} pid {proc.pid} since \d{{4}}-"
        with pytest.raises(RunLockedError, match=rf"run 'live' .* being written by another "
                           rf"process \({holder}"):
            start_run(cfg, overrides, run_id, resume=True, lock=run_lock(cfg.storage, run_id))
        with pytest.raises(RunLockedError, match=holder):
            run_local(cfg, run_id, resume=True)
        assert time.monotonic() - t0 < 5.0  # fails fast
        # ... and touched nothing: no rollback of the live run's files, no resume record.
        assert not store.exists("resumes.jsonl")
        assert before <= _files(tmp_path), "the refused writer removed files of the live run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The holder died mid-append of a metrics row (kill -9): a torn last line.
    with open(store.path("metrics.jsonl"), "ab") as f:
        f.write(b'{"iteration": 1.0, "reward/me')
    # Its lock died with it: --resume works at once, ignoring the torn line with a warning.
    with _storage_warnings() as warned:
        out = run_local(cfg, run_id, resume=True)
    assert out["resumed_from"] == 1
    assert any("torn last line" in r.getMessage() and "metrics.jsonl" in r.getMessage()
               for r in warned)
    rows = store.read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0.0, 1.0, 2.0]
    assert store.list_checkpoints() == [1, 2, 3]
    _ledger_ok(store, 3, cfg, 3)
    # Released at the end of the run: the next writer gets the lock.
    with run_lock(cfg.storage, run_id) as lock:
        assert lock.held


def test_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    overrides = [f"storage.root={tmp_path}", *RUN]
    run_local(load_config(CONFIG, [*overrides, "iterations=2"]), "rot")
    store = RunStore(str(tmp_path), "rot")
    assert store.list_checkpoints() == [1, 2]
    # Bit rot in checkpoint 2: same size, so only the CRC32 can tell.
    path = Path(store.path("checkpoints/00000002/optimizer.safetensors"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.list_checkpoints() == [1, 2]  # complete by size: the manifest's sizes match
    assert store.corrupt_files(2) == ["optimizer.safetensors"] and store.corrupt_files(1) == []

    cfg = load_config(CONFIG, [*overrides, "iterations=3"])
    with _storage_warnings() as records:
        out = run_local(cfg, "rot", resume=True)
    assert out["resumed_from"] == 1
    warned = [r.getMessage() for r in records if "is corrupt" in r.getMessage()]
    assert warned and "checkpoint 2" in warned[0] and "optimizer.safetensors" in warned[0]
    resume = store.read_jsonl("resumes.jsonl")[0]
    assert resume["corrupt"] == {"2": ["optimizer.safetensors"]} and resume["step"] == 1
    assert resume["abandoned"]["torn_checkpoints"] == [2]
    assert store.list_checkpoints() == [1, 2, 3] and store.corrupt_files(2) == []
    _ledger_ok(store, 3, cfg, 3)
    # Every checkpoint corrupt: a resume says so instead of loading garbage.
    for step in (1, 2, 3):
        p = Path(store.path(f"checkpoints/{step:08d}/ledger.json"))
        p.write_bytes(p.read_bytes().replace(b"consumed", b"CONSUMED"))
    with pytest.raises(ResumeError, match=r"no complete checkpoint .*corrupt or not authentic"):
        run_local(cfg, "rot", resume=True)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"), access_key=KEY, secret_key=SECRET)
    yield server
    server.stop()


def test_object_store_lock_refuses_a_second_writer_and_takes_over_a_stale_one(
        s3, prefect_api, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    location = s3.overrides("locks")
    cfg = load_config(CONFIG, [*location, *RUN, "iterations=1", "storage.lock_ttl_s=6"])
    store = RunStore.from_config(cfg.storage, "shared")
    first = run_lock(cfg.storage, "shared").acquire()
    try:
        assert json.loads(store.read_bytes("run.lock"))["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()} since .*heartbeat \d+s "
                           "ago"):
            run_lock(cfg.storage, "shared").acquire()
        # The flow refuses before any cluster starts, with the holder in its message.
        import flows.train

        def no_cluster(*a, **k):
            raise AssertionError("a Dask cluster was started for a run id that is locked")

        monkeypatch.setattr(flows.train, "open_cluster", no_cluster)
        state = flows.train.train(config=CONFIG, run_id="shared",
                                  overrides=[*location, *RUN, "iterations=1"],
                                  return_state=True)
        assert state.is_failed() and f"pid {os.getpid()}" in state.message
        assert "being written by another process" in state.message
        # The heartbeat keeps a live holder's lock fresh past its ttl.
        time.sleep(3.0)
        beat = json.loads(store.read_bytes("run.lock"))["heartbeat"]
        assert time.time() - beat < 3.0 and first.held and not first.lost
    finally:
        first.release()
    assert not store.exists("run.lock")  # released: deleted
    # A dead holder on another host: stale once its heartbeat is older than the ttl.
    dead = {"owner": "x", "host": "gone-host", "pid": 1, "since": time.time() - 100,
            "heartbeat": time.time() - 7}
    store.write_bytes("run.lock", json.dumps(dead).encode())
    with _storage_warnings() as warned, RunLock(store, ttl_s=6) as lock:
        assert json.loads(store.read_bytes("run.lock"))["owner"] == lock.holder["owner"]
    assert any("stale lock" in r.getMessage() and "gone-host" in r.getMessage()
               for r in warned)
    # ... but not while its heartbeat is fresh.
    store.write_bytes("run.lock", json.dumps({**dead, "heartbeat": time.time()}).encode())
    with pytest.raises(RunLockedError, match="host gone-host pid 1"):
        RunLock(store, ttl_s=6).acquire()
