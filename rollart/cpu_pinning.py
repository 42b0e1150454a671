"""CPU cores per hardware class (`cluster.cpu_cores`): disaggregation on one CPU host.

On a GPU cluster each hardware class is its own devices. On one CPU box the classes share the
cores, and two OpenMP pools that both use every core (the trainer's torch threads and the
engine's vLLM threads) slow each other down far more than their share: every parallel region
ends at a barrier that waits for the thread the other pool pre-empted. Giving each class its
own cores makes an asynchronous run (generation of batch k+1 while update k trains) overlap
instead of fight: `cluster.cpu_cores: {H800: "1", H20: "0"}` puts the trainer on core 1 and
the engine on core 0 (benchmarks/vs_trl.py, variant async-vllm).

A service calls `pin_to_class(cluster, hw_class)` in its constructor, on its worker: every
thread of the worker process is pinned (threads made later inherit it), and vLLM's OpenMP
binding is set to the same cores before the engine starts.
"""

from __future__ import annotations

import os
import re

_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def parse_cpu_list(spec: str) -> list[int]:
    """"0", "1-3", "0,2-3" -> sorted core ids (Linux cpu-list syntax). Raises ValueError."""
    spec = spec.replace(" ", "")
    if not _CPU_LIST.fullmatch(spec):
        raise ValueError(f"{spec!r} is not a CPU list: write cores like 0, 1-3 or 0,2-3")
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"{spec!r}: range {part} runs backwards (write {b}-{a})")
        cores.update(range(a, b + 1))
    return sorted(cores)


def pin_process(cores: list[int]) -> None:
    """Pin every thread of this process to `cores` (threads started later inherit it)."""
    n = os.cpu_count() or 1
    bad = [c for c in cores if c >= n]
    if bad:
        raise ValueError(f"cluster.cpu_cores names cores {bad}, but this host has cores "
                         f"0-{n - 1}: use cores that exist here")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def class_cores(cpu_cores: dict[str, str] | None, hw_class: str) -> list[int] | None:
    """The cores `hw_class` is given, or None (unpinned)."""
    if not cpu_cores or hw_class not in cpu_cores:
        return None
    return parse_cpu_list(cpu_cores[hw_class])


def pin_to_class(cpu_cores: dict[str, str] | None, hw_class: str) -> list[int] | None:
    """Pin this worker process to its class's cores and bind vLLM's OpenMP threads to them
    (read when an engine is created). Returns the cores, or None when the class is unpinned."""
    cores = class_cores(cpu_cores, hw_class)
    if cores is None:
        return None
    pin_process(cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return cores
