"""The rows of the generated benchmarks table (docs/hooks.py): one per committed results file.

Each row is (title, command that produced the file, file under results/, headline extractor). An
extractor reads the results JSON and returns the headline with its spread; a file whose format no
longer matches raises, and the table says so (the strict docs build fails on the warning).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from benchmark_rows_agentic import AGENTIC_ROWS

ROOT = Path(__file__).resolve().parent.parent


def load(name: str) -> dict:
    return json.loads((ROOT / "results" / name).read_text())


def committed_date(name: str, data: dict) -> str:
    """The date the results file was last committed (its JSON has the machine and commit)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", f"results/{name}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for key in ("date", "date_utc"):
        for d in (data, data.get("host") if isinstance(data.get("host"), dict) else {}):
            if isinstance(d, dict) and d.get(key):
                return str(d[key])[:10]
    return "n/a"


def _r(lo: float, hi: float, fmt: str = "{:.2f}") -> str:
    return fmt.format(lo) if abs(lo - hi) < 1e-12 else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _quickstart(d: dict) -> str:
    return (f"set-up (`make venv`) {d['setup_s']:.0f} s; first row after {d['first_row_s']:.0f} s; "
            f"greedy evaluation >= 0.9 at iteration {d['iteration_at_0_9']} after "
            f"**{d['time_to_0_9_s_min']:.0f}-{d['time_to_0_9_s_max']:.0f} s** "
            f"({d['runs_reaching_0_9']} runs), final evaluation {d['final_eval_min']:.1f}")


def _learn(d: dict) -> str:
    first = next((int(c["iteration"]) for c in d["curve"]
                  if (c.get("eval/success_rate") or 0) >= 1.0), None)
    return (f"greedy 1.0 first at iteration {first}, stopped after {d['iterations']} iterations "
            f"({d['wall_s']:.0f} s); final {d['final_success']:.2f}")


def _control_plane(d: dict) -> str:
    runs = d["variants"]["threads"]["runs"]
    shares = [r["orchestration_share"] for r in runs]
    its = [r["iteration_s_median"] for r in runs]
    dask = [r["orchestration_share"] for r in d["variants"]["dask"]["runs"]]
    return (f"orchestration share **{_r(min(shares), max(shares), '{:.3f}')}** of "
            f"{_r(min(its), max(its))} s per iteration (threads runner); dask runner "
            f"{_r(min(dask), max(dask))}")


def _async(d: dict) -> str:
    s = d["speedup_by_variant"]
    g = d["final_reward_gap_by_variant"]
    return (f"alpha = 1: **{s['async1']:.2f}x** sync's speed, final reward gap {g['async1']:.3f}; "
            f"alpha = 2: {s['async2']:.2f}x, gap {g['async2']:.3f} ({len(d['seeds'])} seeds)")


def _vs_trl(d: dict) -> str:
    v = d["variants"][d["best_variant"]]
    return (f"**{v['speedup']:.2f}x** TRL's steps/s (rounds {v['speedup_min']:.2f}-"
            f"{v['speedup_max']:.2f}); {v['token_throughput_ratio']:.2f}x per generated token; "
            f"held-out accuracy {d['rollart_final_accuracy']:.2f} vs "
            f"{d['trl_final_accuracy']:.2f}; "
            f"weight sync {d['sync_s']:.2f} s")


def _trainer_heap(d: dict) -> str:
    g, r = d["summary"]["glibc_default"], d["summary"]["rollart"]
    return (f"SmolLM2-135M updates in a worker, glibc's heap policy / rollart's: first two "
            f"**{d['first_two_ratio']:.2f}x** ({g['first_two_s']:.0f} vs "
            f"{r['first_two_s']:.0f} s), "
            f"later {d['later_ratio']:.2f}x; page faults {g['page_faults'] / 1e6:.1f} M vs "
            f"{r['page_faults'] / 1e6:.1f} M")


def _owned_weights(d: dict) -> str:
    m, o, per = d["median"]["mapped"], d["median"]["owned"], d["first_step_ratio_per_round"]
    saved = d["load_and_first_step_saved_s_per_round"]
    return (f"SmolLM2-135M's first AdamW step {m['first_step_s']:.2f} s on the file map, "
            f"{o['first_step_s']:.2f} s owned: **{d['first_step_ratio']:.1f}x** (rounds "
            f"{_r(min(per), max(per), '{:.1f}')}x); load + first step {_r(min(saved), max(saved))} "
            f"s less")


def _engine_compile(d: dict) -> str:
    c, e = d["median"]["compiled"], d["median"]["eager"]
    saved, ratio = d["first_step_saved_s_per_round"], d["later_step_ratio_per_round"]
    return (f"first multi-turn step {c['first_step_s']:.2f} s with vLLM's sampler helpers "
            f"compiled, {e['first_step_s']:.2f} s eager (**{_r(min(saved), max(saved))} s** "
            f"saved per round); later steps compiled / eager {_r(min(ratio), max(ratio))}x")


def _startup(d: dict) -> str:
    b, t, per = d["median"]["baseline"], d["median"]["this"], d["startup_speedup_per_round"]
    return (f"start-up {b['startup_s']:.1f} s before, **{t['startup_s']:.1f} s** after "
            f"(medians; rounds {_r(min(per), max(per))}x); whole command {b['wall_s']:.1f} "
            f"against {t['wall_s']:.1f} s")


def _run_end(d: dict) -> str:
    b, t = d["median"]["baseline"], d["median"]["this"]
    per = [x["finish_s"] for x in d["runs"]["this"]]
    return (f"first iteration {b['first_iteration_s']:.1f} s before, "
            f"**{t['first_iteration_s']:.1f} s** after; from the first row to the command's "
            f"exit {b['finish_s']:.1f} s before, **{t['finish_s']:.1f} s** after (medians; "
            f"after: {_r(min(per), max(per))} s); whole command {b['wall_s']:.1f} against "
            f"{t['wall_s']:.1f} s")


def _checkpoint_snapshot(d: dict) -> str:
    s = d["summary"]
    snap, whole = s["snapshot_s_ratio_per_round"], s["total_s_ratio_per_round"]
    return (f"SmolLM2-135M checkpoint in a trainer worker, previous / packed: snapshot "
            f"**{s['snapshot_s_ratio_median']:.1f}x** ({s['previous_snapshot_s_median']:.1f} vs "
            f"{s['packed_snapshot_s_median']:.1f} s; rounds {_r(min(snap), max(snap))}), with "
            f"the write {s['total_s_ratio_median']:.1f}x ({_r(min(whole), max(whole))}); "
            f"files identical: {d['files_identical']}")


def _kv_block(d: dict) -> str:
    per, (bs, sp) = d["block_sizes"], next(iter(d["speedup_vs_first"].items()))
    first = next(iter(per))
    return (f"guess-game rollouts {per[first]['batch_s_median']:.2f} s per batch at block {first}, "
            f"{per[bs]['batch_s_median']:.2f} s at {bs}: **{sp['pooled']:.2f}x** (rounds "
            f"{_r(min(sp['per_round']), max(sp['per_round']))}x)")


def _engines(d: dict) -> str:
    return (f"vLLM/HF tokens/s **{d['vllm_over_hf']:.2f}x**; log-prob error vs trainer "
            f"{d['logprob_mae_hf']:.1e} (HF), {d['logprob_mae_vllm']:.1e} (vLLM)")


def _rollout_scale(d: dict) -> str:
    h = d["headline"]
    sp = h.get("spread", {})
    p99 = sp.get("overhead_p99_ms_4096") or [h["overhead_p99_ms_4096"]] * 2
    two = sp.get("two_shards_over_one") or [h["two_shards_over_one"]] * 2
    return (f"4,096 episodes, one shard: {h['turns_per_s_4096']:,.0f} turns/s, per-turn overhead "
            f"p99 **{_r(min(p99), max(p99))} ms** (p50 {h['overhead_p50_ms_4096']:.2f}); two "
            f"shards {_r(min(two), max(two))}x one (saturated)")


def _router(d: dict) -> str:
    r = d["ratios"]
    key = next(k for k in r if k.startswith("all_calls:baseline"))
    v = r[key]
    return (f"router CPU per call {v['median']:.2f}x faster than the baseline router "
            f"(repeats {v['min']:.2f}-{v['max']:.2f}); decisions identical: "
            f"{d['decisions_identical']}")


def _affinity(d: dict) -> str:
    return (f"affinity / round robin **{d['speedup_vs_round_robin']:.2f}x** (repeats "
            f"{d['speedup_vs_round_robin_min']:.2f}-{d['speedup_vs_round_robin_max']:.2f}); "
            f"training run {d['run_speedup_vs_round_robin']:.2f}x")


def _elastic(d: dict) -> str:
    return (f"reward p95 fixed pool / elastic **{d['p95_ratio_fixed_over_elastic']:.1f}x** "
            f"(p50 {d['p50_ratio_fixed_over_elastic']:.1f}x)")


def _ckpt(d: dict) -> str:
    return (f"save {d['save_MBps']:.0f} MB/s ({d['save_ratio_vs_boto3']:.2f}x plain boto3), "
            f"load {d['load_MBps']:.0f} MB/s ({d['load_ratio_vs_boto3']:.2f}x)")


def _security(d: dict) -> str:
    w = d["wall_ratio_per_repeat"]
    return (f"secured / open iteration time **{d['overhead_ratio']:.2f}** (pairs "
            f"{d['overhead_ratio_min']:.3f}-{d['overhead_ratio_max']:.3f}); whole run "
            f"{_r(min(w), max(w), '{:.3f}')}")


def _chaos(d: dict) -> str:
    gap = d["final_eval_gap"]
    return (f"{len(d['fault_kinds'])} fault kinds, all recovered: {d['all_recovered']}; "
            f"consumed {d['consumed'][0]:,}, "
            f"duplicated {d['duplicated']}, unaccounted {d['unaccounted']}; final-eval gap "
            f"(clean - chaos) {gap['mean']:.1f}")


def _chaos_spread(d: dict) -> str:
    crash = d["rollout_crash_recovered_s"]
    tr = d["train_success_gap"]
    return (f"{d['faults_n']} faults of {len(d['fault_kinds'])} kinds over "
            f"{len(d['seeds'])} seeds, all recovered: {d['all_recovered']}; duplicated "
            f"{d['duplicated']}, unaccounted {d['unaccounted']}; a broken rollout service "
            f"rebuilt from its live state in {_r(min(crash), max(crash), '{:.1f}')} s; "
            f"final-eval gap {d['final_eval_gap']['mean']:.1f}, training-success gap "
            f"{tr['mean']:+.2f} ({tr['min']:+.2f} to {tr['max']:+.2f})")


def _chaos_rank(d: dict) -> str:
    f = d["faults"][0]
    return (f"a trainer rank killed: detected {f['detected_s']:.0f} s, recovered "
            f"{f['recovered_s']:.0f} s after; duplicated {d['duplicated']}, unaccounted "
            f"{d['unaccounted']}")


def _sharded(d: dict) -> str:
    h = d["headline"]
    return (f"2 ranks vs 1: largest parameter difference {h['update_parity_max_abs']:.1e} "
            f"(bound {h['update_parity_bound']:.1e}); state per rank "
            f"{h['state_bytes_per_rank_ratio_2']:.2f} (2 ranks), "
            f"{h['state_bytes_per_rank_ratio_4']:.2f} (4); resume exact: {h['resume_exact']}")


def _sharded_learning(d: dict) -> str:
    s = d["summary"]
    return (f"held-out accuracy gain {s['accuracy_gain_1'][0]:+.3f} (1 rank), "
            f"{s['accuracy_gain_2'][0]:+.3f} (2 ranks), one seed")


def _weight_sync(d: dict) -> str:
    cap = d["summary_link_capped"]["chain"]
    one, four = cap["1"]["median_s"], cap["4"]["median_s"]
    return (f"1 -> 4 engine hosts, links capped at {d['link_mbit']} Mbit/s: {one:.2f} -> "
            f"{four:.2f} s (**{four / one:.2f}x**)")


def _prefix(d: dict) -> str:
    return (f"shared-prefix update **{d['speedup']:.2f}x** the plain one (repeats "
            f"{d['speedup_min']:.2f}-{d['speedup_max']:.2f}); length buckets "
            f"{d['bucket_speedup']:.2f}x more")


def _sim_async(d: dict) -> str:
    p = d["predicted_over_measured"]["wall"]
    return ("predicted / measured wall " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))


def _sim_cluster(d: dict) -> str:
    return (f"RollArt design vs monolithic sync at 3,072 GPUs **{d['rollart_speedup_3072']:.2f}x** "
            f"({d['rollart_speedup_3072_with_failures']:.2f}x with env failures); validation "
            f"max error {d['validation_max_error']:.3f}")


def _startup_smollm2(baseline: str, out: str) -> str:
    """The SmolLM2 start-up command (light guess task, vLLM engine) against `baseline`."""
    return ("python benchmarks/startup.py --baseline <checkout of " + baseline + "> --rounds 3 "
            "--config configs/smollm2-guess.yaml --set engine.backend=vllm --set "
            "engine.vllm.kv_cache_mb=1024 --set rollout.num_groups=2 --set rollout.group_size=4 "
            "--set eval.episodes=0 --set eval.before_training=false --set 'tasks=[{\"name\":"
            "\"guess\",\"env_id\":\"guess\",\"env_kwargs\":{\"low\":1,\"high\":16,"
            "\"show_range\":true},\"max_turns\":2,\"constrained\":true}]' --out "
            "results/" + out)


# (title, command, results file, headline extractor)
BENCHMARKS: list[tuple[str, str, str, Callable[[dict], str]]] = [
    ("Quickstart (`make venv`, `make train`)", "python benchmarks/quickstart.py --runs 2",
     "quickstart.json", _quickstart),
    ("FrozenLake learning, in-process (seed 0)", "python benchmarks/learn_frozenlake.py "
     "--eval-every 2", "learn_frozenlake.json", _learn),
    ("FrozenLake learning, in-process (seed 1)", "python benchmarks/learn_frozenlake.py "
     "--eval-every 2 --set seed=1 --out results/learn_frozenlake_seed1.json",
     "learn_frozenlake_seed1.json", _learn),
    ("Control plane (Prefect + Dask vs in-process)", "python benchmarks/control_plane.py",
     "control_plane.json", _control_plane),
    ("Asynchrony vs sync", "python benchmarks/async_vs_sync.py --iterations 150 --seeds 0,1,2 "
     "--variants async1,sync,async2 --set train.lr=0.001", "async_vs_sync.json", _async),
    ("Against TRL GRPOTrainer (arithmetic)", "python benchmarks/vs_trl.py --variants "
     "sync-vllm,async-vllm --rounds 2", "vs_trl.json", _vs_trl),
    *AGENTIC_ROWS,  # benchmark_rows_agentic.py
    ("HF vs vLLM engine", "make bench-engines", "engines.json", _engines),
    ("HF vs vLLM engine (Intel Xeon host)", "python benchmarks/engines.py --out "
     "results/engines_intel.json", "engines_intel.json", _engines),
    ("vLLM KV-cache block size, multi-turn rollouts", "python benchmarks/kv_block.py",
     "kv_block.json", _kv_block),
    ("Trainer memory policy in workers", "python benchmarks/trainer_heap.py --rounds 2",
     "trainer_heap.json", _trainer_heap),
    ("First optimizer step on file-mapped and owned weights",
     "python benchmarks/owned_weights.py --rounds 5", "owned_weights.json", _owned_weights),
    ("vLLM's sampler helpers compiled or eager, multi-turn engine steps",
     "python benchmarks/engine_compile.py --rounds 3", "engine_compile.json", _engine_compile),
    ("Start-up of a SmolLM2 run (vLLM engine), against the previous commit",
     _startup_smollm2("the previous commit", "startup_smollm2_light.json"),
     "startup_smollm2_light.json", _startup),
    ("First iteration and end of a SmolLM2 run (vLLM engine), against the commit before "
     "the worker exit and the eager sampler on every thread",
     _startup_smollm2("that commit", "startup_smollm2_exit.json"),
     "startup_smollm2_exit.json", _run_end),
    ("Checkpoint snapshot and write", "python benchmarks/checkpoint_snapshot.py --rounds 2 "
     "--dir /tmp",
     "checkpoint_snapshot.json", _checkpoint_snapshot),
    ("Rollout service at scale", "python benchmarks/rollout_scale.py --repeats 2",
     "rollout_scale.json", _rollout_scale),
    ("Router CPU per decision", "python benchmarks/router_rebuild.py --repeats 11 --calls 3000",
     "router_rebuild.json", _router),
    ("Hardware-affinity routing", "python benchmarks/affinity.py", "affinity.json", _affinity),
    ("Elastic rewards", "python benchmarks/reward_elastic.py", "reward_elastic.json", _elastic),
    ("Checkpoints on S3", "python benchmarks/checkpoint_s3.py", "checkpoint_s3.json", _ckpt),
    ("Security overhead", "python benchmarks/security_overhead.py --repeats 2",
     "security_overhead_rerun.json", _security),
    ("Chaos while learning (3 seeds, 60 iterations)", "python benchmarks/chaos.py --iterations "
     "60 --seeds 0 1 2 --after-greedy", "chaos.json", _chaos_spread),
    ("Chaos (faults spread over 40 iterations, 3 seeds)", "python benchmarks/chaos.py "
     "--iterations 40 --seeds 0 1 2 --out results/chaos_40it.json", "chaos_40it.json",
     _chaos_spread),
    ("Chaos (faults of every kind, 60 iterations)", "python benchmarks/chaos.py --iterations 60 "
     "--seeds 0 --out results/chaos_guard.json", "chaos_guard.json", _chaos),
    ("Chaos: a trainer rank lost", "python benchmarks/chaos.py --scenario trainer_rank "
     "--iterations 8 --seeds 0 --out results/chaos_trainer_rank.json",
     "chaos_trainer_rank.json", _chaos_rank),
    ("Sharded trainer parity and memory", "python benchmarks/sharded_trainer.py",
     "sharded_trainer.json", _sharded),
    ("Sharded trainer learning (SmolLM2 arithmetic)", "python benchmarks/sharded_learning.py",
     "sharded_learning.json", _sharded_learning),
    ("Weight sync to several engine hosts", "python benchmarks/weight_sync.py --link-mbit 1000",
     "weight_sync.json", _weight_sync),
    ("Shared-prefix update", "python benchmarks/update_shared_prefix.py",
     "update_shared_prefix.json", _prefix),
    ("Simulator vs the async benchmark", "python benchmarks/sim_async.py", "sim_async.json",
     _sim_async),
    ("Simulator at cluster scale", "python benchmarks/sim_cluster.py", "sim_cluster.json",
     _sim_cluster),
]
