"""Hardware-affinity routing on emulated H800-like and H20-like engine pools, in one process.

Two HF engine replicas run in this process, one thread each. Each plays its hardware class with
the modelled emulation (rollart.routing.emulation.ServiceModel, issue 21): every forward pass
takes the cost model's time for a `--model-params` model (default 7e9, bf16) on that class,
spent as sleep (prefill: prompt tokens x 2 x params / FLOP/s; decode step: weight bytes /
bandwidth, shared by the batch's rows, as on a GPU) x `--time-scale`. The service time then
depends on token counts only: not on this host's speed, nor on the other replica or the other
processes competing for its cores. `--forward none` (default) skips the real forward pass
(uniform logits; the routing effect is then exact up to thread scheduling); `--forward real`
runs the tiny model's real pass under the modelled time (its CPU time is subtracted; any excess
is reported as `overrun_s` per replica; give it a `--time-scale` large enough to hide the pass).

Workload (identical for every policy within a repeat; seeded): 50/50 mixed multi-turn episodes,
all started at once, each advancing to its next turn as soon as its completion is back:
- prefill-heavy task `obs` (long observations, short actions): 1024-token first prompt,
  +512 observation tokens per later turn, 8 new tokens per turn (`--obs-prompt`,
  `--obs-tokens`);
- decode-heavy task `reason` (short prompts, long reasoning): 16-token first prompt, +8 tokens
  per later turn, 128 new tokens per turn.
No eos (eos_token_ids=[]), so every completion has exactly its max_new_tokens: all policies
generate the same tokens and only placement differs. The HF engine has no prefix cache, so every
turn re-prefills its whole context (the router is told `prefix_cache=False`).

Each replica drains its queue in batches of up to 8 (engine.generate); the batch time goes to
Router.on_batch (the bounded online correction), completions to Router.on_finished and
TaskProfiles, and the episode's next turn is routed at once. Policies: affinity (cost model +
queue), round_robin, least_loaded; all three keep an episode on its replica across turns unless
its wait exceeds the smallest by --threshold-s (the Router's shared stickiness rule), which
makes the two baselines load-aware at turn boundaries (stronger than plain rotation).

Every repeat runs the three policies (order alternating between repeats) on the repeat's seed;
speedup of a repeat = round robin wall / affinity wall within that repeat. Reported: every
repeat's walls, speedups, decisions and placements (turns of each task on each class), and the
min / median / max of the speedups; the summary line prints the minimum. With
`--run-iterations N` (default 12) the same mix also runs as a full training run
(benchmarks/affinity_run.py: configs/affinity-mix.yaml through rollart.runner.local_loop.run_local),
affinity vs round robin, and the median iteration-time ratio is `run_speedup_vs_round_robin`.

Per run and replica, `batch_log` lists every engine call as [start s, busy s, modelled s, rows]:
busy - modelled is the host time the emulation does not model (sleep wake-up, the GIL, building
completions). A few ms of it per batch can decide which branch the affinity run takes
(rollart/sim/validate_affinity.py: `race`), so the simulator's check needs it batch by batch.

Writes results/affinity.json and prints one line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollart.config import TinyModelConfig  # noqa: E402
from rollart.engines import HFEngine  # noqa: E402
from rollart.models import build_tiny_model, build_tokenizer, param_count  # noqa: E402
from rollart.routing import (  # noqa: E402
    DEFAULT_CATALOG,
    POLICIES,
    CostModel,
    ReplicaSpec,
    Router,
    RouteRequest,
    ServiceModel,
    TaskProfiles,
)
from rollart.types import Completion, GenerationRequest, SamplingParams  # noqa: E402

BATCH = 8  # rows per engine.generate call, and the cost model's decode batch


@dataclass(frozen=True)
class TaskSpec:
    name: str
    first_prompt: int
    obs_tokens: int  # appended before each later turn
    new_tokens: int


TASKS = {  # obs sizes: --obs-prompt / --obs-tokens
    "obs": TaskSpec("obs", first_prompt=1024, obs_tokens=512, new_tokens=8),
    "reason": TaskSpec("reason", first_prompt=16, obs_tokens=8, new_tokens=128),
}


@dataclass
class Episode:
    eid: str
    task: TaskSpec
    context: list[int]
    turns_left: int
    new_tokens: int  # prompt tokens added since the previous turn
    turn: int = 0
    submitted_at: float = 0.0
    latencies: list[float] = field(default_factory=list)


class ReplicaServer(threading.Thread):
    """Drains its queue in batches of up to BATCH requests through one engine."""

    def __init__(self, rid: str, engine: HFEngine,
                 on_start: Callable[[str, list[str]], None],
                 on_batch: Callable[[str, list[str], float], None],
                 on_done: Callable[[str, Completion], None]):
        super().__init__(daemon=True, name=rid)
        self.rid, self.engine, self.on_batch, self.on_done = rid, engine, on_batch, on_done
        self.on_start = on_start
        self.q: deque[GenerationRequest] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.busy_s = 0.0
        self.batches = 0
        self.t_zero = 0.0  # the run's start (perf_counter), set before the thread starts
        # per batch: [start s since t_zero, busy s, modelled s, rows]; busy - modelled is the
        # host time the emulation does not model (rollart/sim/validate_affinity.py: the race)
        self.batch_log: list[list[float]] = []

    def submit(self, req: GenerationRequest) -> None:
        with self.cv:
            self.q.append(req)
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()

    def run(self) -> None:
        while True:
            with self.cv:
                while not self.q and not self.stopping:
                    self.cv.wait()
                if not self.q:
                    return
                batch = [self.q.popleft() for _ in range(min(BATCH, len(self.q)))]
            self.on_start(self.rid, [r.request_id for r in batch])
            modelled0 = self.engine.stats().get("emulated_modelled_s", 0.0)
            t0 = time.perf_counter()
            completions = self.engine.generate(batch)
            busy = time.perf_counter() - t0
            modelled = self.engine.stats().get("emulated_modelled_s", 0.0) - modelled0
            self.busy_s += busy
            self.batches += 1
            self.batch_log.append([round(t0 - self.t_zero, 4), round(busy, 4),
                                   round(modelled, 4), len(batch)])
            self.on_batch(self.rid, [r.request_id for r in batch], busy)
            for c in completions:
                self.on_done(self.rid, c)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]


def run_policy(policy: str, engines: dict[str, HFEngine], specs: list[ReplicaSpec],
               cost: CostModel, episodes_per_task: int, turns: int, vocab: int, seed: int,
               threshold_s: float) -> dict:
    rng = random.Random(seed)
    router = Router(specs, cost, policy=policy, sticky=True, imbalance_threshold_s=threshold_s,
                    prefix_cache=False)
    profiles = TaskProfiles(alpha=0.2)
    lock = threading.Lock()
    done = threading.Event()
    eps: dict[str, Episode] = {}
    finished = [0]
    tokens = {t: 0 for t in TASKS}
    placed = {f"{t}/{s.hw.name}": 0 for t in TASKS for s in specs}  # turns of task t on class
    servers: dict[str, ReplicaServer] = {}

    def issue(ep: Episode) -> None:  # caller holds `lock`
        rid = f"{ep.eid}/t{ep.turn}"
        d = router.route(RouteRequest(
            request_id=rid, episode_id=ep.eid, task=ep.task.name, new_tokens=ep.new_tokens,
            context_tokens=len(ep.context) - ep.new_tokens,
            decode_tokens=profiles.expected_decode_tokens(ep.task.name, ep.task.new_tokens)))
        placed[f"{ep.task.name}/{d.hw_class}"] += 1
        ep.submitted_at = time.perf_counter()
        servers[d.replica_id].submit(GenerationRequest(
            rid, list(ep.context), SamplingParams(max_new_tokens=ep.task.new_tokens)))

    def on_start(replica: str, ids: list[str]) -> None:
        with lock:
            router.on_started(replica, ids)

    def on_batch(replica: str, ids: list[str], busy_s: float) -> None:
        with lock:
            router.on_batch(replica, ids, busy_s)

    def on_done(replica: str, c: Completion) -> None:
        with lock:
            router.on_finished(c.request_id)
            ep = eps[c.request_id.split("/")[0]]
            ep.latencies.append(time.perf_counter() - ep.submitted_at)
            tokens[ep.task.name] += len(c.token_ids)
            profiles.observe_turn(ep.task.name, ep.new_tokens, len(c.token_ids))
            ep.turns_left -= 1
            if ep.turns_left == 0:
                router.on_episode_end(ep.eid)
                finished[0] += 1
                if finished[0] == len(eps):
                    done.set()
                return
            t0 = time.perf_counter()  # the "env step": append the next observation
            obs = random_ids(rng, ep.task.obs_tokens, vocab)
            ep.context += c.token_ids + obs
            ep.new_tokens = len(c.token_ids) + len(obs)  # not cached anywhere (HF engine)
            profiles.observe_env_step(ep.task.name, time.perf_counter() - t0)
            ep.turn += 1
            issue(ep)

    order = [t for t in TASKS.values() for _ in range(episodes_per_task)]
    rng.shuffle(order)  # arrival order: a round robin must not get a lucky P/D alternation
    for i, task in enumerate(order):
        ctx = random_ids(rng, task.first_prompt, vocab)
        eps[f"{task.name}{i}"] = Episode(f"{task.name}{i}", task, ctx, turns, len(ctx))
    before = {rid: e.stats() for rid, e in engines.items()}
    servers.update({rid: ReplicaServer(rid, e, on_start, on_batch, on_done)
                    for rid, e in engines.items()})
    t0 = time.perf_counter()
    for s in servers.values():
        s.t_zero = t0
    with lock:  # every first turn is queued before the replicas start: full first batches
        for ep in eps.values():
            issue(ep)
    for s in servers.values():
        s.start()
    done.wait()
    wall = time.perf_counter() - t0
    for s in servers.values():
        s.stop()
        s.join()
    gen = sum(tokens.values())
    per_replica = {}
    for rid, e in engines.items():
        a, b = before[rid], e.stats()
        per_replica[rid] = {
            "busy_s": round(servers[rid].busy_s, 3), "batches": servers[rid].batches,
            "tokens_generated": int(b["tokens_generated"] - a["tokens_generated"]),
            "prompt_tokens": int(b["prompt_tokens"] - a["prompt_tokens"]),
            "emulated_sleep_s": round(b["emulated_sleep_s"] - a["emulated_sleep_s"], 3),
            "modelled_s": round(b["emulated_modelled_s"] - a["emulated_modelled_s"], 3),
            "overrun_s": round(b["emulated_overrun_s"] - a["emulated_overrun_s"], 3),
            "forward_s": round(b["forward_s"] - a["forward_s"], 3),
            "batch_log": servers[rid].batch_log,
        }
    m = router.metrics()
    return {
        "wall_s": wall,
        "gen_tokens": gen,
        "gen_tokens_per_s": gen / wall,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in per_replica.values()) / wall,
        "replicas": per_replica,
        "decisions": {k: int(m[f"router/{k}"]) for k in ("new", "sticky", "spill", "failover")},
        "placed_turns": placed,
        "router_scale": {rid: round(m[f"router/scale/{rid}"], 3) for rid in engines},
        "router_measured_ratio": {rid: round(m[f"router/measured_ratio/{rid}"], 3)
                                  for rid in engines},
        "per_task": {
            t: {"gen_tokens": tokens[t],
                "mean_turn_latency_s": round(statistics.mean(
                    x for e in eps.values() if e.task.name == t for x in e.latencies), 3)}
            for t in TASKS},
        "profile": {k: round(v, 4) for k, v in profiles.metrics().items()},
    }


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3),
            "max": round(max(xs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes-per-task", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threshold-s", type=float, default=0.5, help="stickiness imbalance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--obs-prompt", type=int, default=TASKS["obs"].first_prompt)
    ap.add_argument("--obs-tokens", type=int, default=TASKS["obs"].obs_tokens)
    ap.add_argument("--model-params", type=float, default=7e9, help="modelled model size")
    ap.add_argument("--time-scale", type=float, default=1.0, help="wall s per modelled s")
    ap.add_argument("--forward", choices=("none", "real"), default="none",
                    help="run the tiny model's real forward pass under the modelled time")
    ap.add_argument("--run-iterations", type=int, default=12,
                    help="full training run per policy (0: skip; benchmarks/affinity_run.py)")
    ap.add_argument("--run-config", default="configs/affinity-mix.yaml")
    ap.add_argument("--out", default="results/affinity.json")
    args = ap.parse_args()
    TASKS["obs"] = TaskSpec("obs", args.obs_prompt, args.obs_tokens, TASKS["obs"].new_tokens)

    torch.set_num_threads(1)  # one core per replica thread
    tok = build_tokenizer([f"turn {i}: observation and answer text" for i in range(50)], 320)
    mcfg = TinyModelConfig(hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=2,
                           intermediate_size=512, max_position=8192)
    model = build_tiny_model(mcfg, tok, args.seed).eval()
    # the GPU cost model of the modelled model: bf16 weights, BATCH rows share a decode step
    cost = CostModel.for_model(args.model_params, bytes_per_param=2.0, decode_batch=BATCH,
                               time_scale=args.time_scale)
    specs, engines = [], {}
    for i, cls in enumerate([DEFAULT_CATALOG["H800"], DEFAULT_CATALOG["H20"]]):
        rid = f"{cls.name.lower()}-{i}"
        specs.append(ReplicaSpec(rid, cls))
        sm = ServiceModel(cls, params=args.model_params, bytes_per_param=2.0,
                          time_scale=args.time_scale, forward=args.forward == "real")
        engines[rid] = HFEngine(copy.deepcopy(model), tok, eos_token_ids=[], seed=i,
                                max_batch_size=BATCH, emulate=sm)

    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
        for policy in order:  # alternate the order so drift in machine load hits all alike
            r = run_policy(policy, engines, specs, cost, args.episodes_per_task, args.turns,
                           len(tok), args.seed + rep, args.threshold_s)
            runs[policy].append(r)
            print(f"  rep {rep} {policy:12s} wall {r['wall_s']:6.2f} s  {r['decisions']} "
                  f"placed {r['placed_turns']} busy "
                  f"{[v['busy_s'] for v in r['replicas'].values()]} overrun "
                  f"{[v['overrun_s'] for v in r['replicas'].values()]}", flush=True)

    speedups = {p: [rr["wall_s"] / x["wall_s"] for rr, x in zip(runs["round_robin"], rs,
                                                                 strict=True)]
                for p, rs in runs.items()}
    policies = {p: {"wall_s": spread([r["wall_s"] for r in rs]),
                    "wall_s_runs": [round(r["wall_s"], 3) for r in rs],
                    "speedup_vs_round_robin_runs": [round(x, 3) for x in speedups[p]],
                    "decisions_runs": [r["decisions"] for r in rs],
                    "placed_turns_runs": [r["placed_turns"] for r in rs],
                    "runs": rs} for p, rs in runs.items()}
    aff = spread(speedups["affinity"])
    out = {
        "benchmark": "affinity",
        "what": "one iteration (all episodes, all turns) of a 50/50 prefill-/decode-heavy mix on "
                "emulated H800 + H20 HF engine replicas (modelled service time spent as sleep); "
                "speedup per repeat = round robin wall / affinity wall",
        "command": "python " + " ".join(sys.argv),
        "workload": {"episodes_per_task": args.episodes_per_task, "turns": args.turns,
                     "tasks": {t.name: vars(t) for t in TASKS.values()}, "batch": BATCH,
                     "imbalance_threshold_s": args.threshold_s, "repeats": args.repeats},
        "emulation": {"mode": "modelled", "model_params": args.model_params,
                      "bytes_per_param": 2.0, "time_scale": args.time_scale,
                      "forward": args.forward, "served_model_params": param_count(model)},
        "host": {"cpus": os.cpu_count(), "torch_threads_per_replica": 1},
        "replicas": {s.replica_id: s.hw.model_dump() for s in specs},
        "correction_bound": round(Router(specs, cost).correction_bound, 5),
        "policies": policies,
        "speedup_vs_round_robin_min": aff["min"],
        "speedup_vs_round_robin": aff["median"],
        "speedup_vs_round_robin_max": aff["max"],
        "speedup_vs_round_robin_runs": [round(x, 3) for x in speedups["affinity"]],
        "least_loaded_vs_round_robin": spread(speedups["least_loaded"]),
        "goal": {"speedup_vs_round_robin_min": 1.3, "run_speedup_vs_round_robin": 1.2},
    }
    run_line = ""
    if args.run_iterations > 0:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from affinity_run import measure_runs

        run = measure_runs(args.run_config, args.run_iterations, args.seed)
        out["run"] = run
        out["run_speedup_vs_round_robin"] = run["speedup"]
        out["run_speedup_vs_round_robin_mean"] = run["speedup_mean_after_first"]
        run_line = (f"; full run ({args.run_iterations} iterations) median iteration "
                    f"affinity {run['affinity']['iteration_s']['median']:.2f} s vs round robin "
                    f"{run['round_robin']['iteration_s']['median']:.2f} s: "
                    f"{run['speedup']:.2f}x (mean after the first "
                    f"{run['speedup_mean_after_first']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"affinity: {2 * args.episodes_per_task} episodes x {args.turns} turns, "
          f"{args.repeats} repeats: speedup vs round robin min {aff['min']:.2f}x (median "
          f"{aff['median']:.2f}x, max {aff['max']:.2f}x; wall affinity "
          f"{policies['affinity']['wall_s']['median']:.2f} s, round robin "
          f"{policies['round_robin']['wall_s']['median']:.2f} s, least loaded "
          f"{policies['least_loaded']['wall_s']['median']:.2f} s)" + run_line
          + f" -> {args.out}")


if __name__ == "__main__":
    main()
