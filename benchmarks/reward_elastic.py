"""Elastic vs fixed reward scoring under bursts of episodes that finish together.

Each burst: N episodes end at the same instant (e.g. a batch of groups completing), each reward
costs U(cost_min, cost_max) seconds (the `sleep` handler: wall time, no CPU, so the 2-core box
measures scheduling, not CPU contention). Reward latency = from the burst (submit) to the scored
trajectory, through the production path: LambdaRewardClient -> boto3 -> local Lambda endpoint ->
awslambdaric workers.

- elastic: function concurrency 32 (client concurrency 32); workers scale from zero on demand
  and back to zero after `--idle` seconds;
- fixed: the same endpoint and path with function concurrency 2 (client concurrency 2), i.e. a
  fixed pool of 2 workers.

Between bursts the benchmark waits for the idle period and records the live worker count
(0 = scaled to zero). Writes results/reward_elastic.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.lambda_endpoint import LocalLambda  # noqa: E402
from infra.lambda_functions import FunctionSpec  # noqa: E402
from rollart.rewards.client import LambdaRewardClient  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_mode(lam: LocalLambda, name: str, concurrency: int, costs: list[list[float]],
             idle_s: float) -> dict:
    lat: list[float] = []
    bursts, idle_workers = [], []
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    t_start = time.perf_counter()

    def sample() -> None:  # the live-worker timeline, 10 Hz
        while not stop.wait(0.1):
            live = lam.metrics()["functions"][name]["live_workers"]
            samples.append((round(time.perf_counter() - t_start, 2), live))

    threading.Thread(target=sample, daemon=True).start()
    with LambdaRewardClient(name, endpoint_url=lam.url, max_concurrency=concurrency,
                            timeout_s=30, max_retries=10, credentials=lam.credentials) as client:
        for burst in costs:
            t0 = time.perf_counter()
            done_at: list[float] = [0.0] * len(burst)

            def record(i: int, t0: float = t0, done_at: list[float] = done_at):
                return lambda _: done_at.__setitem__(i, time.perf_counter() - t0)

            futures = []
            for i, cost in enumerate(burst):  # all episodes of the burst end "now"
                fut = client.submit_event({"sample_id": f"{name}/{i}", "cost_s": cost})
                fut.add_done_callback(record(i))
                futures.append(fut)
            for f in futures:
                assert f.result()["reward"] == 1.0
            settle = time.monotonic() + 1.0  # done-callbacks may trail result() by a moment
            while not all(done_at) and time.monotonic() < settle:
                time.sleep(0.001)
            lat += done_at
            peak = lam.metrics()["functions"][name]["peak_workers"]
            bursts.append({"makespan_s": max(done_at), "p95_s": pct(done_at, 0.95),
                           "peak_workers_so_far": peak})
            end = time.monotonic() + idle_s + 5.0  # wait out the idle period: scale to zero
            while time.monotonic() < end and lam.metrics()["functions"][name]["live_workers"]:
                time.sleep(0.1)
            idle_workers.append(lam.metrics()["functions"][name]["live_workers"])
        stats = dict(client.stats)
    stop.set()
    m = lam.metrics()["functions"][name]
    return {
        "concurrency": concurrency, "episodes": len(lat),
        "p50_s": statistics.median(lat), "p95_s": pct(lat, 0.95), "max_s": max(lat),
        "mean_s": statistics.fmean(lat), "bursts": bursts,
        "peak_workers": m["peak_workers"], "idle_workers_after_burst": idle_workers,
        "cold_starts": m["cold_starts"], "throttles_endpoint": m["throttles"],
        "client": stats, "live_workers_timeline": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256, help="episodes per burst")
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--cost-min", type=float, default=0.05)
    ap.add_argument("--cost-max", type=float, default=0.5)
    ap.add_argument("--elastic", type=int, default=32, help="elastic concurrency limit")
    ap.add_argument("--fixed", type=int, default=2, help="fixed pool size")
    ap.add_argument("--idle", type=float, default=2.0, help="idle seconds before scale-down")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/reward_elastic.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    costs = [[rng.uniform(args.cost_min, args.cost_max) for _ in range(args.episodes)]
             for _ in range(args.bursts)]
    specs = [FunctionSpec("elastic", "sleep", concurrency=args.elastic, timeout_s=30),
             FunctionSpec("fixed", "sleep", concurrency=args.fixed, timeout_s=30)]
    t0 = time.perf_counter()
    with LocalLambda(specs, idle_timeout_s=args.idle) as lam:
        elastic = run_mode(lam, "elastic", args.elastic, costs, args.idle)
        fixed = run_mode(lam, "fixed", args.fixed, costs, args.idle)
    ratio = fixed["p95_s"] / elastic["p95_s"]
    out = {
        "episodes_per_burst": args.episodes, "bursts": args.bursts,
        "cost_s": [args.cost_min, args.cost_max], "mean_cost_s": statistics.fmean(
            c for b in costs for c in b),
        "fixed_pool": f"same endpoint, function concurrency {args.fixed}, client concurrency "
                      f"{args.fixed}",
        "elastic": elastic, "fixed": fixed,
        "p95_ratio_fixed_over_elastic": ratio,
        "p50_ratio_fixed_over_elastic": fixed["p50_s"] / elastic["p50_s"],
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"reward_elastic: {args.bursts}x{args.episodes} episodes, cost "
          f"{args.cost_min}-{args.cost_max}s | elastic(<= {args.elastic}) p50 "
          f"{elastic['p50_s']:.2f}s p95 {elastic['p95_s']:.2f}s peak {elastic['peak_workers']} "
          f"workers, idle {elastic['idle_workers_after_burst']} | fixed({args.fixed}) p50 "
          f"{fixed['p50_s']:.2f}s p95 {fixed['p95_s']:.2f}s | p95 ratio {ratio:.1f}x "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
