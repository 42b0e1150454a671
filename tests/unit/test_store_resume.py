"""Exact resume (local store, in-process loop) and the sample-id ledger."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from rollart.config import load_config
from rollart.rollout.plan import plan_iteration
from rollart.storage.ledger import LedgerError, SampleLedger
from rollart.storage.resume import ResumeError, prepare_resume, resume_config, start_run
from rollart.storage.store import RunStore

CONFIG = str(Path(__file__).parents[2] / "configs" / "default.yaml")
BASE = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "storage.save_every=2", "storage.keep_last=5"]


def test_ledger_refuses_a_sample_twice_and_audits():
    led = SampleLedger()
    led.consume([("a", 0), ("b", 0)], step=1)
    led.drop([("c", 0, "env_error")], step=1)
    with pytest.raises(LedgerError, match="'a' would be consumed at step 2 but was already"):
        led.consume([("a", 0)], step=2)
    with pytest.raises(LedgerError):
        led.drop([("c", 0, "again")], step=2)
    led.set_pending([("d", 1)], step=1)
    audit = led.audit(["a", "b", "c", "d", "e"])
    assert audit.missing == ["e"] and not audit.duplicates and not audit.ok
    back = SampleLedger.from_json(led.to_json())
    back.consume([("d", 1)], step=2)  # a restored pending sample is consumed once
    assert back.fate("d") == "consumed" and back.counts() == {"consumed": 3, "dropped": 1,
                                                               "pending": 0}
    assert back.audit(["a", "b", "c", "d"]).ok


def _ledger_of(store: RunStore, step: int) -> SampleLedger:
    files, _ = store.load_checkpoint(step, only=["ledger.json"])
    return SampleLedger.from_json(files["ledger.json"])


# The runs of the exact-resume test, in a fresh interpreter: the checkpoint holds the process's
# global `random` and numpy states (rng.json, for env code that draws from them; rollart itself
# never does). Any draw from them that depends on timing (a retry's jitter, a thread left by an
# earlier test) makes a resumed run's rng.json differ from the straight run's, which this test
# once saw on a fresh clone. So the script watches both generators from before anything else is
# imported and reports every draw with its caller (`DRAWS`); the test asserts there are none, so
# a new draw fails here by name instead of as a rare byte difference.
_RUNS = """
import collections, json, random, sys, traceback
import numpy as np
DRAWS = collections.Counter()
HERE = (random.__file__, np.random.__file__.rsplit("/", 1)[0], "<string>")

def note(what):
    caller = next((f for f in reversed(traceback.extract_stack()[:-2])
                   if not f.filename.startswith(HERE)), None)
    DRAWS[f"{what} at {caller.filename}:{caller.lineno}" if caller else what] += 1

class Watched(random.Random):  # every draw reaches random() or getrandbits()
    def random(self):
        note("random.random")
        return super().random()

    def getrandbits(self, k):
        note("random.getrandbits")
        return super().getrandbits(k)

    def seed(self, *a, **kw):
        note("random.seed")
        return super().seed(*a, **kw)

old, new = random._inst, Watched()
new.setstate(old.getstate())
for name in dir(random):
    if getattr(getattr(random, name), "__self__", None) is old:
        setattr(random, name, getattr(new, name))
random._inst = new

def watch(name, fn):
    def wrapped(*a, **kw):
        note(f"numpy.random.{name}")
        return fn(*a, **kw)
    return wrapped

for name in dir(np.random):
    fn = getattr(np.random, name)
    if getattr(fn, "__self__", None) is np.random.mtrand._rand and name not in (
            "get_state", "set_state"):
        setattr(np.random, name, watch(name, fn))
DRAWS.clear()  # Watched() seeded itself

from rollart.config import load_config
from rollart.runner.local_loop import run_local
from rollart.storage.store import RunStore
config, root, base = sys.argv[1], sys.argv[2], sys.argv[3:]
run_local(load_config(config, [*base, root, "iterations=3"]), "straight")
run_local(load_config(config, [*base, root, "iterations=2"]), "resumed")
# The interrupted attempt: iteration 2 ran (shard + metrics row) and checkpoint 3 was torn.
b = RunStore(root.split("=", 1)[1], "resumed")
b.write_bytes("checkpoints/00000003/model.safetensors", b"torn")
b.write_shard(2, b.read_shards(1))
b.append_jsonl("metrics.jsonl", {"iteration": 2.0, "reward/mean": 9.0})
out = run_local(load_config(config, [*base, root, "iterations=3"]), "resumed", resume=True)
print("resumed_from", out["resumed_from"])
print("DRAWS", json.dumps(DRAWS))
"""


def test_resume_is_exact_and_the_ledger_has_no_duplicates_or_gaps(tmp_path):
    """Run A: 3 iterations straight. Run B: 2 iterations, stop, resume to 3. Every file of the
    final checkpoint is byte-identical (weights, optimizer, RNG, engine RNG, ledger)."""
    root = f"storage.root={tmp_path}"
    done = subprocess.run([sys.executable, "-c", _RUNS, CONFIG, root, *BASE],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed_from 2" in done.stdout
    draws = json.loads(done.stdout.split("DRAWS ", 1)[1])
    assert draws == {}, f"draws from the global generators that checkpoints save: {draws}"
    b = RunStore(str(tmp_path), "resumed")

    a = RunStore(str(tmp_path), "straight")
    files_a, man_a = a.load_checkpoint(3)
    files_b, man_b = b.load_checkpoint(3)
    assert set(files_a) >= {"model.safetensors", "optimizer.safetensors", "optimizer.json",
                            "rng.safetensors", "rng.json", "engine_rng.safetensors", "ledger.json",
                            "config.yaml", "trainer_state.json"}
    assert {k: files_a[k] == files_b[k] for k in files_a} == {k: True for k in files_a}
    assert man_b["train_step"] == 3 and man_b["next_iteration"] == 3

    cfg = load_config(CONFIG, [*BASE, root, "iterations=3"])
    issued = [s.sample_id for i in range(3) for s in plan_iteration(cfg, i)]
    ledger = _ledger_of(b, 3)
    counts = Counter(ledger.ids())
    assert set(counts) == set(issued) and max(counts.values()) == 1  # no gap, no duplicate
    assert ledger.audit(issued).ok and man_b["ledger"]["ok"]
    steps = {r[0]: r[3] for r in ledger.records}
    assert all(steps[s.sample_id] == i + 1 for i in range(3) for s in plan_iteration(cfg, i))

    # The torn checkpoint, the abandoned shard and metrics row were rolled back (and kept aside).
    assert b.list_checkpoints() == [2, 3]
    rows = b.read_jsonl("metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0.0, 1.0, 2.0] and rows[2]["reward/mean"] != 9
    resumes = b.read_jsonl("resumes.jsonl")
    assert resumes[0]["abandoned"]["torn_checkpoints"] == [3]
    assert resumes[0]["abandoned"]["shard_iterations"] == [2]
    assert b.read_jsonl("abandoned/attempt-1/metrics.jsonl")[0]["reward/mean"] == 9.0


def test_resume_config_keeps_the_run_plan_and_takes_location_from_now(tmp_path):
    cfg = load_config(CONFIG, [*BASE, f"storage.root={tmp_path}", "iterations=3", "seed=7"])
    start_run(cfg, [], "r", resume=False)
    store = RunStore(str(tmp_path), "r")
    assert yaml.safe_load(store.read_text("config.yaml"))["seed"] == 7
    # Resume with the default config + only the location: the stored run config wins.
    now = load_config(CONFIG, [f"storage.root={tmp_path}"])
    merged = resume_config(now, ["iterations=10"], store)
    assert merged.seed == 7 and merged.iterations == 10 and merged.rollout.group_size == 2
    with pytest.raises(ResumeError, match="different 'rollout'"):
        resume_config(now, ["rollout.group_size=4"], store)
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        prepare_resume(store)
    with pytest.raises(ResumeError, match="no run"):
        resume_config(now, [], RunStore(str(tmp_path), "missing"))
    # An attempt that died before its first complete checkpoint is started over, not refused.
    store.write_bytes("checkpoints/00000001/model.safetensors", b"torn")
    store.append_jsonl("metrics.jsonl", {"iteration": 0.0})
    start_run(cfg, [], "r", resume=False)
    assert store.checkpoint_steps() == [] and not store.read_jsonl("metrics.jsonl")
    assert store.read_jsonl("resumes.jsonl")[0]["abandoned"]["torn_checkpoints"] == [1]
    store.save_checkpoint(1, {"a": b"a"}, {"iteration": 0})
    with pytest.raises(ResumeError, match="already has checkpoints"):
        start_run(cfg, [], "r", resume=False)


def test_weight_versions_in_the_store_direct_and_store_mediated_sync(tmp_path):
    from rollart.runner.local_loop import run_local
    from rollart.storage.weights import latest_weights_version, load_weights

    root = f"storage.root={tmp_path}"
    # Store-mediated sync: the trainer publishes weights/v{n}, engines pull that version.
    out = run_local(load_config(CONFIG, [*BASE, root, "iterations=2", "storage.sync_via_store=true",
                                         "storage.weights_keep_last=5"]), "via-store")
    m = out["curve"][-1]
    assert m["perf/weights_pull_s"] > 0 and m["perf/sync_bytes"] > 0 and m["perf/sync_s"] > 0
    store = RunStore(str(tmp_path), "via-store")
    assert latest_weights_version(store) == 2
    engine, trainer = out["engines"][0], out["trainer"]
    assert engine.weight_version() == 2 and engine.fingerprint() == trainer.fingerprint()
    # Direct sync stays the default; `weights_every` publishes versions in the background.
    out = run_local(load_config(CONFIG, [*BASE, root, "iterations=2", "storage.weights_every=1",
                                         "storage.weights_keep_last=1"]), "direct")
    store = RunStore(str(tmp_path), "direct")
    assert "perf/weights_pull_s" not in out["curve"][-1]
    assert sorted(store.listdir("weights")) == ["v2"]  # retention kept the newest only
    final = load_weights(store, 2)
    trained = out["trainer"].trainer.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in final.items())
