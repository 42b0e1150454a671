"""benchmarks/affinity.py records every engine call's host time beyond the modelled sleep.

The simulator cannot predict which branch the affinity run takes when a few ms of host time per
batch decide a race (rollart/sim/validate_affinity.py: `race`); the per-run averages the file
held could not say when that time was spent. ReplicaServer now logs each batch."""

import importlib.util
import sys
import time
from pathlib import Path

from rollart.types import GenerationRequest, SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "affinity.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("affinity_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


class FakeEngine:
    """Models 5 ms per call and takes 8 ms (3 ms of 'host time')."""

    def __init__(self):
        self.modelled = 0.0

    def stats(self):
        return {"emulated_modelled_s": self.modelled}

    def generate(self, batch):
        time.sleep(0.008)
        self.modelled += 0.005
        return []


def test_replica_server_logs_busy_and_modelled_time_per_batch():
    mod = load_bench()
    seen = []
    srv = mod.ReplicaServer("r0", FakeEngine(), lambda rid, ids: None,
                            lambda rid, ids, busy: seen.append((len(ids), busy)),
                            lambda rid, c: None)
    srv.t_zero = time.perf_counter()
    for i in range(mod.BATCH + 3):
        srv.submit(GenerationRequest(f"q{i}", [1, 2], SamplingParams(max_new_tokens=1)))
    srv.start()
    deadline = time.time() + 10
    while sum(n for n, _ in seen) < mod.BATCH + 3 and time.time() < deadline:
        time.sleep(0.01)
    srv.stop()
    srv.join()
    log = srv.batch_log
    assert [row[3] for row in log] == [n for n, _ in seen]
    assert sum(row[3] for row in log) == mod.BATCH + 3
    for start, busy, modelled, _ in log:
        assert start >= 0 and modelled == 0.005 and busy >= 0.008 > modelled
    assert log == sorted(log)  # in start order
