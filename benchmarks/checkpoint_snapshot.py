"""A trainer worker's checkpoint, the way rollart writes it against the way it wrote it before:
the blocking snapshot and the local write, after real updates, in a fresh trainer worker.

    .venv/bin/python benchmarks/checkpoint_snapshot.py [--rounds 3] [--updates 3]

Each measurement spawns an H800-class Dask worker with rollart's worker environment
(infra/dask_cluster.WORKER_ENVIRON), builds the SmolLM2-135M trainer, runs `--updates` updates
of synthetic guess-task batches (benchmarks/trainer_heap.py), then takes one checkpoint:

    packed    Trainer.checkpoint_files(): each tensor copied once into page-aligned chunks
              (rollart/train/safetensors_pack.py); atomic_write sends them with O_DIRECT
    previous  safetensors.torch.save of cloned weights and of the AdamW state (bytes), written
              through the page cache; the code before the packed files

and writes it with `atomic_write` (fsync, rename) into a directory of its own. One checkpoint
per worker: a worker keeps the memory it freed, so a second snapshot in the same worker would
find its memory already there, and a run's final checkpoint does not. Variants alternate
(AB, BA, ...). After the timed checkpoint each worker also makes the other variant's files
from the same trainer and compares them byte for byte.

Writes results/checkpoint_snapshot.json and prints one summary line. Seconds are examples from
one host; compare the variants through the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agentic_results import host_facts  # noqa: E402

VARIANTS = ("packed", "previous")


def previous_files(trainer: Any) -> dict[str, bytes]:
    """The tensor files as rollart wrote them before packing: cloned, then serialized."""
    import safetensors.torch

    from rollart.storage.weights import tie_key

    seen, state = set(), {}
    for k, v in trainer.model.state_dict().items():
        if tie_key(v) not in seen:  # a tied weight once, as the trainer writes it
            seen.add(tie_key(v))
            state[k] = v.detach().contiguous().clone()
    opt = {f"state.{i}.{name}": t.detach().contiguous()
           for i, entry in trainer.optimizer.state_dict()["state"].items()
           for name, t in entry.items() if hasattr(t, "contiguous")}
    return {"model.safetensors": safetensors.torch.save(state),
            "optimizer.safetensors": safetensors.torch.save(opt)}


def checkpoint_in_worker(variant: str, updates: int, threads: int, out_dir: str
                         ) -> dict[str, Any]:
    """In a fresh trainer worker: `updates` updates, then one checkpoint of `variant`."""
    import resource

    from benchmarks.trainer_heap import synthetic_trainer
    from rollart.storage.files import atomic_write

    trainer, batch_of = synthetic_trainer(threads)
    for it in range(updates):
        trainer.update(batch_of(it))

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    f0, t0 = faults(), time.perf_counter()
    if variant == "packed":
        files = {k: v for k, v in trainer.checkpoint_files().items()
                 if k in ("model.safetensors", "optimizer.safetensors")}
    else:
        files = previous_files(trainer)
    snapshot_s, f1 = time.perf_counter() - t0, faults()
    for name, data in files.items():
        atomic_write(str(Path(out_dir) / name), data)
    write_s, f2 = time.perf_counter() - t0 - snapshot_s, faults()
    # Untimed: the other variant's files from the same trainer, byte for byte.
    packed = files if variant == "packed" else trainer.checkpoint_files()
    before = files if variant == "previous" else previous_files(trainer)
    identical = all(packed[k] == before[k] for k in before)
    return {"identical": identical, "variant": variant, "snapshot_s": round(snapshot_s, 2),
            "write_s": round(write_s, 2),
            "total_s": round(snapshot_s + write_s, 2), "snapshot_page_faults": f1 - f0,
            "write_page_faults": f2 - f1,
            "bytes": sum(len(v) for v in files.values())}


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians per variant and, per round, previous / packed for the snapshot and the whole."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        for key in ("snapshot_s", "write_s", "total_s"):
            out[f"{v}_{key}_median"] = round(statistics.median(r[v][key] for r in rounds), 2)
    for key in ("snapshot_s", "total_s"):
        ratios = [r["previous"][key] / max(r["packed"][key], 1e-9) for r in rounds]
        out[f"{key}_ratio_per_round"] = [round(x, 2) for x in ratios]
        out[f"{key}_ratio_median"] = round(statistics.median(ratios), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: "
                    "the temporary directory; a tmpfs there has no O_DIRECT)")
    ap.add_argument("--out", default=str(ROOT / "results/checkpoint_snapshot.json"))
    args = ap.parse_args()
    import infra.dask_cluster as dc
    from benchmarks.trainer_heap import MODEL
    from benchmarks.worker_malloc import in_worker

    if not MODEL.exists():
        sys.exit(f"{MODEL} is missing: `rollart models fetch smollm2-135m-instruct`")
    host = host_facts()
    work = Path(tempfile.mkdtemp(prefix="rollart-ckpt-bench-", dir=args.dir))
    rounds: list[dict[str, dict[str, Any]]] = []
    identical = True
    try:
        for r in range(args.rounds):
            got: dict[str, dict[str, Any]] = {}
            for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                d = work / f"{r}-{v}"
                d.mkdir()
                got[v] = in_worker(dict(dc.WORKER_ENVIRON), checkpoint_in_worker, v,
                                   args.updates, args.threads, str(d))
                print(r, got[v], flush=True)
            identical &= all(m["identical"] for m in got.values())
            rounds.append(got)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = summarise(rounds)
    result = {"benchmark": "checkpoint_snapshot",
              "command": " ".join([".venv/bin/python", *sys.argv]), "host": host,
              "model": "SmolLM2-135M-Instruct (float32), weights + AdamW moments",
              "updates": args.updates, "threads": args.threads, "files_identical": identical,
              "summary": s, "rounds": rounds}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint_snapshot: snapshot {s['previous_snapshot_s_median']} -> "
          f"{s['packed_snapshot_s_median']} s (per round {s['snapshot_s_ratio_per_round']}x), "
          f"snapshot + write {s['previous_total_s_median']} -> {s['packed_total_s_median']} s "
          f"(per round {s['total_s_ratio_per_round']}x), files identical: {identical} "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
