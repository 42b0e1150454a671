"""Torch step time in the driver and in Dask workers spawned with different environments.

Times 3 forward+backward steps of the tiny Llama (64 x 250 tokens) with 1 and 2 threads: in the
driver, and in an H800-class worker spawned with Dask's default pre-spawn environment
(MALLOC_TRIM_THRESHOLD_=65536, OMP/MKL/OPENBLAS threads = 1), with rollart's (infra/dask_cluster
.WORKER_ENVIRON), and with none. All in one process, so the ratios compare.

Writes results/worker_malloc.json and prints one summary line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
T = TypeVar("T")


def step_times() -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=220, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=256))
    x = torch.randint(0, 220, (64, 250))
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        for _ in range(3):
            model(input_ids=x).logits.float().logsumexp(-1).mean().backward()
        out[f"threads_{threads}_s"] = round(time.perf_counter() - t0, 3)
    return out


def in_worker(environ: dict, fn: Callable[..., T] | None = None, *args: Any) -> T:
    """`fn(*args)` (default: `step_times()`) in a fresh H800-class worker spawned with
    `environ` as its pre-spawn environment."""
    from distributed import Client

    import infra.dask_cluster as dc

    saved, process_env = dict(dc.WORKER_ENVIRON), dict(os.environ)
    dc.WORKER_ENVIRON.clear()
    dc.WORKER_ENVIRON.update(environ)
    try:
        with dc.HardwareClassCluster(workers={"H800": 1}, dashboard=False) as cluster:
            with Client(cluster) as client:
                return client.submit(fn or step_times, *args, resources={"H800": 1},
                                     pure=False).result()
    finally:
        dc.WORKER_ENVIRON.clear()
        dc.WORKER_ENVIRON.update(saved)
        # The nanny writes its pre-spawn environment into this process's os.environ: the next
        # variant's worker would inherit it.
        os.environ.clear()
        os.environ.update(process_env)


def main() -> None:
    import infra.dask_cluster as dc

    dask_default = {"MALLOC_TRIM_THRESHOLD_": 65536, "OMP_NUM_THREADS": 1,
                    "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}
    result = {"driver": step_times(), "worker_dask_default": in_worker(dask_default),
              "worker_rollart": in_worker(dict(dc.WORKER_ENVIRON)),
              "worker_no_spawn_environ": in_worker({})}
    for k in ("threads_1_s", "threads_2_s"):
        result[f"slowdown_{k}"] = round(
            result["worker_dask_default"][k] / result["worker_rollart"][k], 2)
    out = Path("results/worker_malloc.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"worker_malloc: dask-default/rollart environ 1 thread "
          f"{result['slowdown_threads_1_s']}x, 2 threads {result['slowdown_threads_2_s']}x; "
          f"worker/driver 1 thread "
          f"{result['worker_rollart']['threads_1_s'] / result['driver']['threads_1_s']:.2f}x "
          f"-> {out}")


if __name__ == "__main__":
    main()
