"""Chaos benchmark: one training run through the real flow with workers killed at scripted
points; checks that the run completes and that the final checkpoint's ledger accounts for
every sample exactly once.

Cluster: nanny-managed Dask workers on loopback, the way a cluster manager runs them (a killed
worker process is started again by its nanny and joins as a new worker of its class):
H800 x1 (trainer), H20 x2 (two engine replicas), CPU x2 (env hosts; the rollout service on the
first). Tiny model, FrozenLake, local rewards. The fault schedule (by rows of metrics.jsonl):

  trainer   kill -9 of the trainer worker once checkpoint 2 exists and iteration 2 is done:
            the run re-creates its services and resumes from the latest complete checkpoint
  engine    kill -9 of an engine worker two iterations after the restart: its turns go to the
            other replica; a replacement is created on the restarted worker
  env       kill -9 of the env-host worker that does not hold the rollout service, two
            iterations later: its episodes fail and are re-issued on the other host

Per fault: detected_s (injection -> the run noticed: the replica/host marked lost, or the
restart began), recovered_s (injection -> the run is back: the replacement in rotation, the
restarted run past the iteration it had reached, the next iteration done), episodes lost.
For the run: completed, iterations, and from the final ledger: consumed, dropped by reason,
duplicated, unaccounted. Writes results/chaos.json and prints one summary line.

    python benchmarks/chaos.py            (~4-6 min on 2 idle cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKERS = {"H800": 1, "H20": 2, "CPU": 2}


def overrides(iterations: int, root: str) -> list[str]:
    return ["rollout.num_groups=2", "rollout.group_size=4", "tasks.0.max_turns=4",
            "eval.episodes=0", "reward.backend=local", "cluster.dashboard=false",
            "storage.save_every=2", "engine.replicas=2", "cluster.call_timeout_s=60",
            "cluster.max_restarts=2", "rollout.env_timeout_s=30",
            f"iterations={iterations}", f"storage.root={root}"]


def holding(client: Any, prefix: str) -> list[str]:
    actors = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors])
    return [a for a, keys in actors.items() if any(k.startswith(prefix) for k in keys)]


class Chaos:
    """Injects the schedule from a thread while the flow runs; records injection times."""

    def __init__(self, client: Any, store: Any) -> None:
        self.client, self.store = client, store
        self.faults: list[dict[str, Any]] = []
        self.error: str | None = None

    def rows(self) -> list[dict[str, Any]]:
        return self.store.read_jsonl("metrics.jsonl") if self.store.exists(
            "metrics.jsonl") else []

    def wait_rows(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.rows()) < n:
            time.sleep(0.2)

    def kill(self, kind: str, victim: str) -> None:
        reached = len(self.rows())
        t = time.time()
        try:
            self.client.run(os._exit, 1, workers=[victim])
        except Exception:  # the worker died before answering: that is the point
            pass
        self.faults.append({"kind": kind, "worker": victim, "injected_at": t,
                            "rows_at_injection": reached})

    def run(self) -> None:
        try:
            while 2 not in self.store.list_checkpoints() or len(self.rows()) < 3:
                time.sleep(0.2)
            self.kill("trainer", holding(self.client, "TrainerService")[0])
            self.wait_rows(self.faults[-1]["rows_at_injection"] + 2)
            self.kill("engine", holding(self.client, "engine-")[0])
            self.wait_rows(len(self.rows()) + 2)
            rollout = set(holding(self.client, "rollout-"))
            env = [a for a in holding(self.client, "env-host-") if a not in rollout]
            self.kill("env", env[0])
        except Exception as err:  # reported in the result, never silently
            self.error = f"{type(err).__name__}: {err}"


def first_row_after(rows_at: list[tuple[float, int]], t0: float, iteration: int) -> float | None:
    """The time the metrics file first showed `iteration` done after t0."""
    for t, it in rows_at:
        if t > t0 and it >= iteration:
            return t - t0
    return None


def summarise(out: dict[str, Any], chaos: Chaos, rows_at: list[tuple[float, int]],
              ledger: Any) -> list[dict[str, Any]]:
    r = out["rollout"]
    faults = []
    for f in chaos.faults:
        t0 = f["injected_at"]
        entry = {"kind": f["kind"], "worker": f["worker"]}
        if f["kind"] == "trainer":
            rs = [x for x in out.get("restarts", []) if x["failed_at"] >= t0]
            entry["detected_s"] = rs[0]["failed_at"] - t0 if rs else None
            entry["recovered_s"] = first_row_after(rows_at, t0, f["rows_at_injection"])
            entry["restarted_from_checkpoint"] = rs[0]["from_checkpoint"] if rs else None
            entry["iterations_redone"] = (f["rows_at_injection"] - rs[0]["from_checkpoint"]
                                          if rs else None)
            entry["episodes_lost"] = 0  # rolled back with their update, issued again
        elif f["kind"] == "engine":
            lost = [e for e in r.get("engine_events", []) if e["event"] == "lost"
                    and e["t"] >= t0]
            back = [e for e in r.get("engines_revived", []) if e["t"] >= t0]
            entry["detected_s"] = lost[0]["t"] - t0 if lost else None
            entry["recovered_s"] = back[0]["t"] - t0 if back else None
            entry["how"] = back[0]["how"] if back else None
            entry["turns_reissued"] = r["counters"].get("turns_reissued", 0)
            entry["episodes_lost"] = 0 if "engine_error" not in Counter(
                x[4] for x in ledger.records if x[2] == "dropped") else None
        else:
            lost = [e for e in r.get("host_events", []) if e["t"] >= t0]
            entry["detected_s"] = lost[0]["t"] - t0 if lost else None
            entry["recovered_s"] = first_row_after(rows_at, t0, f["rows_at_injection"])
            entry["episodes_lost"] = r["counters"].get("failed", 0)  # failed, re-issued
            entry["episodes_reissued"] = r["counters"].get("retried", 0)
        entry["recovered"] = entry["detected_s"] is not None and entry["recovered_s"] is not None
        faults.append(entry)
    return faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "results" / "chaos.json"))
    args = ap.parse_args()

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from distributed import Client

    from flows.train import train
    from infra.dask_cluster import HardwareClassCluster
    from infra.prefect_server import free_port, start_server
    from rollart.config import load_config
    from rollart.storage.checkpointing import audit_ledger
    from rollart.storage.ledger import SampleLedger
    from rollart.storage.store import RunStore

    tmp = tempfile.mkdtemp(prefix="rollart-chaos-")
    server = start_server(state_dir=Path(tmp) / "prefect", port=free_port())
    os.environ["PREFECT_API_URL"] = server.api_url
    ov = overrides(args.iterations, tmp)
    store = RunStore(tmp, "chaos")
    rows_at: list[tuple[float, int]] = []
    stop = threading.Event()

    def watch_rows() -> None:  # when each iteration's row appeared (rollbacks included)
        seen = 0
        while not stop.wait(0.2):
            rows = store.read_jsonl("metrics.jsonl") if store.exists("metrics.jsonl") else []
            if len(rows) != seen:
                seen = len(rows)
                if rows:
                    rows_at.append((time.time(), int(rows[-1]["iteration"]) + 1))

    t0 = time.time()
    completed, error, out = False, None, {}
    chaos: Chaos | None = None
    try:
        with HardwareClassCluster(workers=WORKERS, dashboard=False) as cluster, \
                Client(cluster.scheduler_address) as client:
            chaos = Chaos(client, store)
            threading.Thread(target=chaos.run, daemon=True).start()
            threading.Thread(target=watch_rows, daemon=True).start()
            try:
                out = train(config="configs/default.yaml", overrides=ov, run_id="chaos",
                            scheduler_address=cluster.scheduler_address)
                completed = isinstance(out, dict)
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
    finally:
        stop.set()
        server.stop()
    wall = time.time() - t0
    rows = store.read_jsonl("metrics.jsonl") if store.exists("metrics.jsonl") else []
    result: dict[str, Any] = {
        "command": "python benchmarks/chaos.py" + (
            f" --iterations {args.iterations}" if args.iterations != 10 else ""),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "workers": WORKERS, "overrides": ov, "wall_s": round(wall, 1),
        "completed": completed and [r["iteration"] for r in rows] == [
            float(i) for i in range(args.iterations)],
        "iterations": len(rows), "error": error or (chaos.error if chaos else None),
    }
    if completed and chaos is not None:
        files, _ = store.load_checkpoint(args.iterations, only=["ledger.json"])
        ledger = SampleLedger.from_json(files["ledger.json"])
        audit = audit_ledger(ledger, load_config("configs/default.yaml", ov), args.iterations)
        reasons = Counter(x[4] for x in ledger.records if x[2] == "dropped")
        result.update({
            "faults": summarise(out, chaos, rows_at, ledger),
            "restarts": out.get("restarts", []),
            "consumed": audit.consumed, "dropped": dict(reasons),
            "duplicated": len(audit.duplicates),
            "unaccounted": len(audit.missing) + len(audit.unexpected),
            "ledger_ok": audit.ok,
            "final_reward": rows[-1].get("reward/mean") if rows else None,
            "rollout_counters": out["rollout"]["counters"],
        })
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    f = {x["kind"]: x for x in result.get("faults", [])}
    print(f"chaos: completed={result['completed']} iterations={result['iterations']} "
          f"consumed={result.get('consumed')} duplicated={result.get('duplicated')} "
          f"unaccounted={result.get('unaccounted')} "
          + " ".join(f"{k}: detected {_s(v['detected_s'])} recovered {_s(v['recovered_s'])}"
                     for k, v in f.items())
          + f" wall {wall:.0f}s -> {args.out}")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


if __name__ == "__main__":
    main()
