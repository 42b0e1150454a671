"""CPU cost of one routing decision at rollout-service scale: 8 replicas, ~200 outstanding each.

Replays an event stream like the rollout service's at 4,096 concurrent episodes: every engine
call finishes 1-2 of a replica's 8 oldest outstanding requests (`on_batch`, then `on_finished`,
which drops that replica's cached queue cost), and each finished turn's episode routes its next
turn (or ends, and a new episode routes its first), so nearly every `route` rebuilds one
replica's queue cost. Affinity policy, sticky, prefix cache, `CostModel.for_model(135e6,
decode_batch=8)`, four H800 and four H20 replicas.

Variants, interleaved over `--repeats` (same seed, so the same events and decisions):
- `new`: rollart.routing.Router as it is in this checkout;
- `plain`: the same Router with every rebuild done by the generic `QueueCost.of` loop over the
  replica's queue (the `Uncached`-style path), to isolate what reusing batch windows buys;
- `baseline`: Router and cost module loaded from git revision `--baseline-rev` (the code before
  batch-window reuse and the other route savings), when git can show it.
Every variant's decisions must equal `new`'s (checked; the script fails otherwise). The time is
that of the router calls only (route, on_batch, on_finished, on_episode_end), per route, with
the cyclic collector off as in the rollout service's event loop.

    .venv/bin/python benchmarks/router_rebuild.py        # -> results/router_rebuild.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rollart.routing.router as router_mod  # noqa: E402
from rollart.routing import DEFAULT_CATALOG  # noqa: E402
from rollart.routing.cost import QueueCost  # noqa: E402

BASELINE_REV = "ceb7bc2fde310f2fbdb40aab4122a7dd3c947482"  # before the batch-window reuse
TASKS = (  # (new prompt tokens range, expected decode tokens): prefill- and decode-heavy turns
    ((800, 4000), 48.0), ((100, 600), 900.0), ((300, 1500), 256.0), ((50, 300), 1500.0))


def load_baseline(rev: str) -> types.ModuleType | None:
    """The router module at `rev`, importing the cost module of the same revision."""
    mods = {}
    for name in ("cost", "router"):
        try:
            src = subprocess.run(["git", "show", f"{rev}:rollart/routing/{name}.py"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        src = src.replace("from rollart.routing.cost import", "from _baseline_cost import")
        mod = types.ModuleType(f"_baseline_{name}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(src, f"{rev[:8]}:{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["router"]


def plain_class(base: type) -> type:
    class PlainRebuild(base):  # type: ignore[misc, valid-type]
        """Every rebuild through the generic QueueCost.of loop over the replica's queue."""

        def _queued_cost(self, rep):
            if rep.queued_cost is None:
                rep.queued_cost = QueueCost.of(self.cost, rep.spec.hw, self._queued(rep))
            return rep.queued_cost

        def _running_cost(self, rep):
            if rep.running_cost is None:
                rep.running_cost = QueueCost.of(self.cost, rep.spec.hw, [
                    v for k, v in rep.outstanding.items() if k in rep.running]
                    if rep.running else ())
            return rep.running_cost

    return PlainRebuild


def run(mod: types.ModuleType, cls: type, per_replica: int, calls: int, seed: int
        ) -> tuple[float, float, int, list[tuple[Any, ...]]]:
    """Router-call seconds (all, route alone), routes, decisions of one replay."""
    hws = [DEFAULT_CATALOG["H800"]] * 4 + [DEFAULT_CATALOG["H20"]] * 4
    specs = [mod.ReplicaSpec(f"r{i}", hw) for i, hw in enumerate(hws)]
    cost = sys.modules[mod.CostModel.__module__].CostModel.for_model(135e6, decode_batch=8)
    router = cls(specs, cost, policy="affinity", sticky=True, prefix_cache=True)
    rng = random.Random(seed)
    ctx: dict[str, int] = {}  # episode -> context tokens
    queue: dict[str, list[str]] = {s.replica_id: [] for s in specs}  # outstanding, in order
    decisions: list[tuple[Any, ...]] = []
    clock = time.perf_counter
    spent, in_route, routes, n_eps = 0.0, 0.0, 0, 0

    def request(eid: str, turn: int) -> Any:
        (lo, hi), decode = TASKS[int(eid[1:]) % len(TASKS)]
        return mod.RouteRequest(f"{eid}/{turn}", eid, "t", new_tokens=rng.randint(lo, hi),
                                context_tokens=ctx[eid], decode_tokens=decode * rng.uniform(
                                    0.9, 1.1))

    def placed(req: Any, d: Any) -> None:
        queue[d.replica_id].append(req.request_id)
        ctx[req.episode_id] += req.new_tokens + int(req.decode_tokens)
        decisions.append((d.replica_id, d.reason, d.est_service_s, d.est_wait_s))

    for _ in range(per_replica * len(specs)):  # fill: every episode's first turn
        eid = f"e{n_eps}"
        n_eps += 1
        ctx[eid] = 0
        req = request(eid, 0)
        placed(req, router.route(req))
    turns = {f"e{i}": 1 for i in range(n_eps)}
    rids = [s.replica_id for s in specs]
    weights = [1.0] * len(rids)
    for _ in range(calls):
        for i, r in enumerate(rids):
            weights[i] = len(queue[r])
        rid = rng.choices(rids, weights)[0]  # replicas finish calls in proportion to load
        head = queue[rid][:8]  # the engine's current batch
        done = rng.sample(head, min(len(head), 1 if rng.random() < 0.72 else 2))
        for k in done:
            queue[rid].remove(k)
        nxt = []
        for k in done:
            eid = k.split("/")[0]
            if rng.random() < 0.1:  # the episode ends; a new one starts
                nxt.append((eid, None))
                eid = f"e{n_eps}"
                n_eps += 1
                ctx[eid], turns[eid] = 0, 0
            nxt.append((eid, request(eid, turns[eid])))
            turns[eid] += 1
        busy = rng.uniform(0.05, 0.5)
        t0 = clock()
        router.on_batch(rid, done, busy)
        for k in done:
            router.on_finished(k)
        t1 = clock()
        ds = [router.route(req) if req is not None else router.on_episode_end(eid)
              for eid, req in nxt]
        t2 = clock()
        spent, in_route = spent + t2 - t0, in_route + t2 - t1
        for (_, req), d in zip(nxt, ds, strict=True):
            if req is not None:
                placed(req, d)
                routes += 1
    return spent, in_route, routes, decisions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-replica", type=int, default=200, help="outstanding requests each")
    ap.add_argument("--calls", type=int, default=20000, help="engine calls replayed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--out", default=str(ROOT / "results" / "router_rebuild.json"))
    args = ap.parse_args()
    variants: dict[str, tuple[types.ModuleType, type]] = {
        "new": (router_mod, router_mod.Router),
        "plain": (router_mod, plain_class(router_mod.Router))}
    old = load_baseline(args.baseline_rev)
    if old is not None:
        variants["baseline"] = (old, old.Router)
    us: dict[str, list[float]] = {v: [] for v in variants}
    us_route: dict[str, list[float]] = {v: [] for v in variants}  # route calls alone
    ref = None
    for rep in range(args.repeats):
        for name, (mod, cls) in variants.items():
            gc.collect()
            gc.disable()  # as the rollout service's event loop runs (rollout/aio_runner.py)
            try:
                spent, in_route, routes, decisions = run(mod, cls, args.per_replica, args.calls,
                                                         args.seed)
            finally:
                gc.enable()
            ref = decisions if ref is None else ref
            if decisions != ref:
                raise SystemExit(f"{name}: decisions differ from the first variant's")
            us[name].append(1e6 * spent / routes)
            us_route[name].append(1e6 * in_route / routes)
            print(f"repeat {rep} {name:9s} {us[name][-1]:7.2f} us/route, all router calls; "
                  f"{us_route[name][-1]:7.2f} in route ({routes} routes)", flush=True)

    def stats(v: list[float]) -> dict[str, Any]:
        return {"per_repeat": v, "median": statistics.median(v), "min": min(v), "max": max(v)}

    summary = {name: {"all_calls_us_per_route": stats(us[name]),
                      "route_us_per_route": stats(us_route[name])} for name in variants}
    ratios = {f"{part}:{name}/new": stats([o / n for o, n in zip(d[name], d["new"], strict=True)])
              for part, d in (("all_calls", us), ("route", us_route))
              for name in variants if name != "new"}
    out = {"config": {**vars(args), "replicas": "4 x H800 + 4 x H20", "decode_batch": 8,
                      "model_params": 135e6, "policy": "affinity", "sticky": True,
                      "prefix_cache": True, "python": sys.version.split()[0]},
           "variants": summary,
           "ratios": ratios,
           "decisions_identical": True}
    for k, v in out["ratios"].items():
        print(f"{k}: median {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
