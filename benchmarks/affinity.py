"""Hardware-affinity routing on emulated H800-like and H20-like engine pools, in one process.

Two HF engine replicas of the same random-init Llama (~0.5M params) run on this CPU host, one
thread each (torch 1 thread each). Emulation (rollart.engines.hf, `emulate=`) sleeps after every
forward pass so that each replica behaves like its class *as a scaled GPU*: the host's time per
prefill token and per decode token (batch 8) is measured first, then
rollart.routing.host_matched_slowdowns picks per-phase factors that give each class the cost
model's per-token times (2 x params FLOPs / FLOP/s; bf16 param bytes / 8 / bandwidth) times one
common scale. Relative to each other: H20 prefill 989/148 = 6.7x slower than H800, H800 decode
4000/3350 = 1.19x slower than H20, and decode/prefill cost per token as on the GPU (~37 on
H800), not as on a CPU (~5 here, which would make every task look prefill-bound).

Workload (identical for every policy within a repeat; seeded): 50/50 mixed multi-turn episodes,
all started at once, each advancing to its next turn as soon as its completion is back:
- prefill-heavy task `obs` (long observations, short actions): 1024-token first prompt,
  +512 observation tokens per later turn, 8 new tokens per turn;
- decode-heavy task `reason` (short prompts, long reasoning): 16-token first prompt, +8 tokens
  per later turn, 128 new tokens per turn.
No eos (eos_token_ids=[]), so every completion has exactly its max_new_tokens: all policies
generate the same tokens and only placement differs. The HF engine has no prefix cache, so every
turn re-prefills its whole context (the router is told `prefix_cache=False`).

Each replica drains its queue in batches of up to 8 (engine.generate); the batch time goes to
Router.on_batch (online correction of the cost model), completions to Router.on_finished and
TaskProfiles, and the episode's next turn is routed at once. Policies: affinity (cost model +
queue), round_robin, least_loaded; all three keep an episode on its replica across turns unless
its wait exceeds the smallest by --threshold-s (the Router's shared stickiness rule), which
makes the two baselines load-aware at turn boundaries (stronger than plain rotation).

Writes results/affinity.json (per policy: median wall time of the repeats = one iteration,
generation tokens/s, per-replica busy/sleep time, router decisions) and prints one line.
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
    TaskProfiles,
    emulated_class,
    emulation_slowdowns,
    host_matched_slowdowns,
)
from rollart.types import Completion, GenerationRequest, SamplingParams  # noqa: E402

BATCH = 8  # rows per engine.generate call, and the cost model's decode batch


@dataclass(frozen=True)
class TaskSpec:
    name: str
    first_prompt: int
    obs_tokens: int  # appended before each later turn
    new_tokens: int


TASKS = {
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
                 on_batch: Callable[[str, list[str], float], None],
                 on_done: Callable[[str, Completion], None]):
        super().__init__(daemon=True, name=rid)
        self.rid, self.engine, self.on_batch, self.on_done = rid, engine, on_batch, on_done
        self.q: deque[GenerationRequest] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.busy_s = 0.0
        self.batches = 0

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
            t0 = time.perf_counter()
            completions = self.engine.generate(batch)
            busy = time.perf_counter() - t0
            self.busy_s += busy
            self.batches += 1
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
    servers: dict[str, ReplicaServer] = {}

    def issue(ep: Episode) -> None:  # caller holds `lock`
        rid = f"{ep.eid}/t{ep.turn}"
        d = router.route(RouteRequest(
            request_id=rid, episode_id=ep.eid, task=ep.task.name, new_tokens=ep.new_tokens,
            context_tokens=len(ep.context) - ep.new_tokens,
            decode_tokens=profiles.expected_decode_tokens(ep.task.name, ep.task.new_tokens)))
        ep.submitted_at = time.perf_counter()
        servers[d.replica_id].submit(GenerationRequest(
            rid, list(ep.context), SamplingParams(max_new_tokens=ep.task.new_tokens)))

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
    servers.update({rid: ReplicaServer(rid, e, on_batch, on_done) for rid, e in engines.items()})
    t0 = time.perf_counter()
    for s in servers.values():
        s.start()
    with lock:
        for ep in eps.values():
            issue(ep)
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
            "emulated_sleep_s": round(b["emulated_prefill_s"] + b["emulated_decode_s"]
                                      - a["emulated_prefill_s"] - a["emulated_decode_s"], 3),
        }
    m = router.metrics()
    return {
        "wall_s": wall,
        "gen_tokens": gen,
        "gen_tokens_per_s": gen / wall,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in per_replica.values()) / wall,
        "replicas": per_replica,
        "decisions": {k: int(m[f"router/{k}"]) for k in ("new", "sticky", "spill", "failover")},
        "router_scale": {rid: round(m[f"router/scale/{rid}"], 2) for rid in engines},
        "per_task": {
            t: {"gen_tokens": tokens[t],
                "mean_turn_latency_s": round(statistics.mean(
                    x for e in eps.values() if e.task.name == t for x in e.latencies), 3)}
            for t in TASKS},
        "profile": {k: round(v, 4) for k, v in profiles.metrics().items()},
    }


def calibrate(engine: HFEngine, vocab: int) -> tuple[float, float]:
    """Host seconds per prefill token and per decode token (rows of a BATCH batch), best of 2."""
    rng = random.Random(1)

    def timed(prompt: int, new: int) -> float:
        reqs = [GenerationRequest(f"c{i}", random_ids(rng, prompt, vocab),
                                  SamplingParams(max_new_tokens=new)) for i in range(BATCH)]
        t0 = time.perf_counter()
        engine.generate(reqs)
        return time.perf_counter() - t0

    timed(64, 4)  # warm-up
    p = TASKS["obs"].first_prompt
    t_prefill = min(timed(p, 1) for _ in range(2))
    n = TASKS["reason"].new_tokens
    t_decode = min(timed(TASKS["reason"].first_prompt, n) for _ in range(2))
    return t_prefill / (BATCH * p), t_decode / (BATCH * n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes-per-task", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threshold-s", type=float, default=0.5, help="stickiness imbalance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dilation", type=float, default=1.0,
                    help="smallest emulation factor (>= 1): > 1 leaves the CPU more idle")
    ap.add_argument("--out", default="results/affinity.json")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one core per replica thread
    sys.setswitchinterval(0.0005)  # decode steps are many short GIL holds; don't make them queue
    tok = build_tokenizer([f"turn {i}: observation and answer text" for i in range(50)], 320)
    mcfg = TinyModelConfig(hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=2,
                           intermediate_size=512, max_position=4096)
    model = build_tiny_model(mcfg, tok, args.seed).eval()
    params = param_count(model)
    # the GPU cost model: bf16 weights, BATCH rows share each decode step's weight read
    cost = CostModel.for_model(params, bytes_per_param=2.0, decode_batch=BATCH)

    real = [DEFAULT_CATALOG["H800"], DEFAULT_CATALOG["H20"]]
    host_p, host_d = calibrate(HFEngine(model, tok, eos_token_ids=[]), len(tok))
    slow = host_matched_slowdowns(real, cost.flops_per_token, cost.bytes_per_token, host_p,
                                  host_d, args.dilation)
    specs, engines = [], {}
    for i, cls in enumerate(real):
        rid = f"{cls.name.lower()}-{i}"
        specs.append(ReplicaSpec(rid, emulated_class(
            cls, cost.flops_per_token, cost.bytes_per_token, host_p, host_d, slow[cls.name])))
        engines[rid] = HFEngine(copy.deepcopy(model), tok, eos_token_ids=[], seed=i,
                                max_batch_size=BATCH, emulate=slow[cls.name])

    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
        for policy in order:  # alternate the order so drift in machine load hits all alike
            r = run_policy(policy, engines, specs, cost, args.episodes_per_task, args.turns,
                           len(tok), args.seed + rep, args.threshold_s)
            runs[policy].append(r)
            print(f"  rep {rep} {policy:12s} wall {r['wall_s']:6.2f} s  "
                  f"{r['gen_tokens_per_s']:7.1f} gen tok/s  {r['decisions']} "
                  f"busy {[v['busy_s'] for v in r['replicas'].values()]} "
                  f"scale {r['router_scale']}", flush=True)

    def summary(rs: list[dict]) -> dict:
        med = sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]
        return {"wall_s": round(med["wall_s"], 3),
                "wall_s_runs": [round(r["wall_s"], 3) for r in rs],
                "gen_tokens_per_s": round(med["gen_tokens_per_s"], 1),
                **{k: v for k, v in med.items() if k not in ("wall_s", "gen_tokens_per_s")}}

    policies = {p: summary(rs) for p, rs in runs.items()}
    rr = policies["round_robin"]["wall_s"]
    speedups = {p: round(rr / s["wall_s"], 3) for p, s in policies.items()}
    out = {
        "benchmark": "affinity",
        "what": "one iteration (all episodes, all turns) of a 50/50 prefill-/decode-heavy mix on "
                "emulated H800-like + H20-like HF engine replicas; median of repeats",
        "model_params": params,
        "workload": {"episodes_per_task": args.episodes_per_task, "turns": args.turns,
                     "tasks": {t.name: vars(t) for t in TASKS.values()}, "batch": BATCH,
                     "imbalance_threshold_s": args.threshold_s, "repeats": args.repeats},
        "host": {"prefill_us_per_token": round(host_p * 1e6, 2),
                 "decode_us_per_token": round(host_d * 1e6, 2),
                 "relative_slowdowns": {c: vars(x) for c, x in emulation_slowdowns(real).items()},
                 "torch_threads_per_replica": 1, "cpus": os.cpu_count()},
        "emulation": {"dilation": args.dilation, **{c: vars(s) for c, s in slow.items()}},
        "replicas": {s.replica_id: s.hw.model_dump() for s in specs},
        "policies": policies,
        "speedup_vs_round_robin": speedups["affinity"],
        "speedup_vs_round_robin_by_policy": speedups,
        "goal": 1.3,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"affinity: {2 * args.episodes_per_task} episodes x {args.turns} turns; wall "
          + ", ".join(f"{p} {s['wall_s']:.2f} s ({s['gen_tokens_per_s']:.0f} tok/s)"
                      for p, s in policies.items())
          + f"; speedup vs round robin {speedups['affinity']:.2f}x (least_loaded "
          f"{speedups['least_loaded']:.2f}x) -> {args.out}")


if __name__ == "__main__":
    main()
