"""`cluster.cpu_cores`: cpu-list parsing, config errors that say how to fix them, and a process
really pinned (every thread, threads started later too)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollart.config import ConfigError, load_config
from rollart.cpu_pinning import class_cores, parse_cpu_list

CONFIG = "configs/smollm2-arith.yaml"
CORES = 'cluster.cpu_cores={"H800": "1", "H20": "0"}'


@pytest.mark.parametrize(("spec", "cores"), [("0", [0]), ("1-3", [1, 2, 3]),
                                             ("0,2-3", [0, 2, 3]), ("3,1", [1, 3])])
def test_parse_cpu_list(spec, cores):
    assert parse_cpu_list(spec) == cores


@pytest.mark.parametrize(("spec", "says"), [("a", "not a CPU list"), ("3-1", "backwards"),
                                            ("1,", "not a CPU list")])
def test_bad_cpu_lists_say_what_to_write(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_cpu_list(spec)


def test_config_checks_classes_threads_and_manager():
    cfg = load_config(CONFIG, [CORES, "train.threads=1", "engine.threads=1"])
    assert class_cores(cfg.cluster.cpu_cores, "H800") == [1]
    assert class_cores(cfg.cluster.cpu_cores, "CPU") is None  # unpinned class
    with pytest.raises(ConfigError, match="set train.threads <= 1"):
        load_config(CONFIG, [CORES, "engine.threads=1"])  # train.threads 2 on one core
    with pytest.raises(ConfigError, match="set engine.threads <= 1"):
        load_config(CONFIG, [CORES, "train.threads=1"])
    with pytest.raises(ConfigError, match="no workers"):
        load_config(CONFIG, ['cluster.cpu_cores={"A100": "0"}'])
    with pytest.raises(ConfigError, match="local manager"):
        load_config(CONFIG, [CORES, "train.threads=1", "engine.threads=1",
                             "cluster.manager=address", "cluster.address=tcp://127.0.0.1:1"])


def test_pin_to_class_pins_every_thread_and_binds_vllm():
    """In a fresh process: a thread started before and one after pinning both end up on the
    class's core, and vLLM's OpenMP binding names it."""
    core = max(os.sched_getaffinity(0))
    code = f"""
import os, threading, time
from rollart.cpu_pinning import pin_to_class
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
assert pin_to_class({{"H20": "{core}"}}, "H20") == [{core}]
assert pin_to_class({{"H20": "{core}"}}, "CPU") is None
after = threading.Thread(target=stop.wait); after.start()
for tid in os.listdir("/proc/self/task"):
    assert os.sched_getaffinity(int(tid)) == {{{core}}}, tid
assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "{core}"
stop.set()
print("pinned")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.getcwd(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pinned"
