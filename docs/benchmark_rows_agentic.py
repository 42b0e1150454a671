"""The agentic rows of the generated benchmarks table (benchmark_rows.py, docs/hooks.py): the
multi-turn tasks, their base rates and the guess game against TRL's GRPOTrainer.

Rows are (title, command that produced the file, file under results/, headline extractor), in
the table's order.
"""

from __future__ import annotations

from collections.abc import Callable


def _r(lo: float, hi: float) -> str:
    from benchmark_rows import _r as span  # the table's range format (imported late: no cycle)

    return span(lo, hi)


def _agentic_vs_trl(d: dict) -> str:
    tok, env = d["tokens_per_s_ratio_per_seed"], d["env_steps_per_s_ratio_per_seed"]
    return (f"tokens/s **{d['tokens_per_s_ratio']:.2f}x** TRL's over whole runs (seeds "
            f"{_r(min(tok.values()), max(tok.values()))}), env steps/s "
            f"{d['env_steps_per_s_ratio']:.2f}x ({_r(min(env.values()), max(env.values()))}); "
            f"held-out gain {d['rollart_success_gain']:.3f} vs TRL {d['trl_success_gain']:.3f}")


def _agentic_gains(d: dict) -> str:
    n = len(d["seeds"])
    return (f"held-out gain over {n} seeds rollart **{d['rollart_success_gain']:.3f}** (sd "
            f"{d['rollart_success_gain_sd']:.3f}) vs TRL **{d['trl_success_gain']:.3f}** (sd "
            f"{d['trl_success_gain_sd']:.3f}); standard error of the difference "
            f"{d['success_gain_diff_se']:.3f}")


def _agentic_update_check(d: dict) -> str:
    u, e, s = d["update_vs_trl"], d["engine"], d["sampler_calibration"]
    return (f"{len(u['steps'])} stored batches through rollart's trainer and TRL's "
            f"GRPOTrainer: weights {u['weights_rel_diff']:.0e} of their change apart, "
            f"gradients {u['gradient_rel_diff']:.0e}; engine and trainer log-probs within "
            f"{e['logprob_mismatch_max']:.0e}; engine samples vs the policy: KS p "
            f"{s['ks_pvalue']:.2f}, surprise z {s['surprise_z']:+.2f} over {s['tokens']} tokens")


def _agentic_sampler_check(d: dict) -> str:
    def side(v: dict) -> str:
        o, t, g = v["opening"], v["later_turns"], v["within_group"]
        out = (f"opening KS p {o['ks_pvalue']:.2f}, z {o['surprise_z']:+.2f}; later turns KS "
               f"p {t['ks_pvalue']:.2f}, z {t['surprise_z']:+.2f}; within groups p "
               f"{g['pvalue']:.2f}, across calls p {v['across_calls']['pvalue']:.2f}")
        if "rare_draws" in t:
            r = t["rare_draws"]
            out += (f"; later-turn draws at P < e^{r['logp_below']:.0f}: {r['observed']} "
                    f"(expected {r['expected']:.1f})")
        if "reported_logprob_max_gap" in t:
            gap = max(o["reported_logprob_max_gap"], t["reported_logprob_max_gap"])
            out += f"; reported log-probs within {gap:.0e} of exact"
        return out
    names = {"rollart_vllm": "rollart's vLLM engine", "trl_generate": "TRL's generate"}
    return f"base model, {d['prompts']} prompts: " + "; ".join(
        f"{names[k]} {side(d[k])}" for k in names if k in d)


def _base_rate(d: dict) -> str:
    r = d["runs"]
    return ", ".join(f"{k} {v['success_rate']:.2f}" for k, v in r.items())


def _multitask(d: dict) -> str:
    out = []
    for name, t in d["tasks"].items():
        before, after = t.get("eval_success_before"), t.get("eval_success_after")
        if before is not None and after is not None:
            out.append(f"{name} {before:.2f} -> {after:.2f}")
    return "held-out greedy success " + ", ".join(out) if out else d["summary"]


AGENTIC_ROWS: list[tuple[str, str, str, Callable[[dict], str]]] = [
    ("Against TRL GRPOTrainer (multi-turn guess game)", "python benchmarks/agentic_vs_trl.py "
     "--group-size 4 --seeds 0,1,2,3 --constrained", "agentic_vs_trl.json", _agentic_vs_trl),
    ("Against TRL, guess game, dynamic sampling (rollart's 10 seeds against TRL's earlier runs)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--resample-uniform 2 --seeds 0,1,2,3,4,5,6,7,8,9 --trl-from results/agentic_vs_trl.json,"
     "results/agentic_vs_trl_seeds4-5.json,results/agentic_vs_trl_seeds6-9.json --out "
     "results/agentic_vs_trl_resample_rerun.json", "agentic_vs_trl_resample_rerun.json",
     _agentic_vs_trl),
    ("Against TRL, guess game, dynamic sampling (seeds 0-4, both sides in one invocation)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --resample-uniform 2 "
     "--seeds 0,1,2,3,4 --out results/agentic_vs_trl_resample_both.json",
     "agentic_vs_trl_resample_both.json", _agentic_vs_trl),
    ("Against TRL, guess game, dynamic sampling (seeds 0-4, both sides, Intel Xeon host, KV block "
     "128)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --resample-uniform 2 "
     "--seeds 0,1,2,3,4 --out results/agentic_vs_trl_resample_both_intel.json",
     "agentic_vs_trl_resample_both_intel.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched (seeds 0-4, Intel Xeon host, TRL's runs above, KV block "
     "128)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_resample_both_intel.json "
     "--out results/agentic_vs_trl_seeds0-4_intel.json",
     "agentic_vs_trl_seeds0-4_intel.json", _agentic_vs_trl),
    ("Against TRL, guess game, rollart's engine in bfloat16 (seeds 0-4, Intel Xeon host, KV block "
     "128)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--engine-dtype bfloat16 --seeds 0,1,2,3,4 --trl-from "
     "results/agentic_vs_trl_resample_both_intel.json --out "
     "results/agentic_vs_trl_bf16_seeds0-4_intel.json",
     "agentic_vs_trl_bf16_seeds0-4_intel.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched (seeds 0-4, Intel Xeon host, TRL's runs above)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_resample_both_intel.json "
     "--out results/agentic_vs_trl_seeds0-4_intel_block32.json",
     "agentic_vs_trl_seeds0-4_intel_block32.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, again (seeds 0-4, Intel Xeon host, TRL's runs above)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_resample_both_intel.json "
     "--out results/agentic_vs_trl_seeds0-4_intel_block32_rerun.json",
     "agentic_vs_trl_seeds0-4_intel_block32_rerun.json", _agentic_vs_trl),
    ("Against TRL, guess game, dynamic sampling (seeds 0-4, Intel Xeon host, TRL's runs above)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--resample-uniform 2 --seeds 0,1,2,3,4 --trl-from "
     "results/agentic_vs_trl_resample_both_intel.json --out "
     "results/agentic_vs_trl_resample_seeds0-4_intel_block32.json",
     "agentic_vs_trl_resample_seeds0-4_intel_block32.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, both sides timed together (seeds 0-4, Intel Xeon "
     "host)",
     "python benchmarks/agentic_results.py --out results/agentic_vs_trl_matched_intel_session.json "
     "results/agentic_vs_trl_trl_seeds0-2_intel_again.json "
     "results/agentic_vs_trl_trl_seeds3-4_intel_again.json "
     "results/agentic_vs_trl_seeds0-4_intel_startup.json",
     "agentic_vs_trl_matched_intel_session.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, both sides timed together, rollart's other "
     "invocation (seeds 0-4, Intel Xeon host)",
     "python benchmarks/agentic_results.py --out "
     "results/agentic_vs_trl_matched_intel_session_before.json "
     "results/agentic_vs_trl_trl_seeds0-2_intel_again.json "
     "results/agentic_vs_trl_trl_seeds3-4_intel_again.json "
     "results/agentic_vs_trl_seeds0-4_intel_block32_baseline.json",
     "agentic_vs_trl_matched_intel_session_before.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, both sides timed in the same hours, the start-up "
     "without the worker exit and the eager sampler on every thread (seeds 0-4, Intel Xeon "
     "host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_trl_seeds0-4_intel_third.json "
     "--out results/agentic_vs_trl_seeds0-4_intel_light.json",
     "agentic_vs_trl_seeds0-4_intel_light.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, both sides timed in the same hours (seeds 0-4, Intel "
     "Xeon host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_trl_seeds0-4_intel_fourth.json "
     "--out results/agentic_vs_trl_seeds0-4_intel_exit.json",
     "agentic_vs_trl_seeds0-4_intel_exit.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, the same an hour later (seeds 0-4, Intel Xeon host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--seeds 0,1,2,3,4 --trl-from results/agentic_vs_trl_trl_seeds0-4_intel_fourth.json "
     "--out results/agentic_vs_trl_seeds0-4_intel_exit_rerun.json",
     "agentic_vs_trl_seeds0-4_intel_exit_rerun.json", _agentic_vs_trl),
    ("Against TRL, guess game, dynamic sampling, both sides timed in the same hours (seeds "
     "0-4, Intel Xeon host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --frameworks rollart "
     "--resample-uniform 2 --seeds 0,1,2,3,4 --trl-from "
     "results/agentic_vs_trl_trl_seeds0-4_intel_fourth.json --out "
     "results/agentic_vs_trl_resample_seeds0-4_intel_exit.json",
     "agentic_vs_trl_resample_seeds0-4_intel_exit.json", _agentic_vs_trl),
    ("Against TRL, guess game, matched, each seed's two runs back to back (seeds 10-19, Intel "
     "Xeon host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained "
     "--seeds 10,11,12,13,14,15,16,17,18,19 --out results/agentic_vs_trl_seeds10-19_intel.json",
     "agentic_vs_trl_seeds10-19_intel.json", _agentic_vs_trl),
    ("Against TRL, guess game, held-out gain over twenty seeds (gains only: the runs come from "
     "several hosts and days)",
     "python benchmarks/agentic_results.py --out results/agentic_vs_trl_seeds0-19_pooled.json "
     "results/agentic_vs_trl.json results/agentic_vs_trl_seeds4-5.json "
     "results/agentic_vs_trl_seeds6-9.json results/agentic_vs_trl_seeds10-19_intel.json",
     "agentic_vs_trl_seeds0-19_pooled.json", _agentic_gains),
    ("Against TRL, guess game, matched, each seed's two runs back to back (seeds 20-23 of an "
     "invocation for 20-25 stopped after seed 23, Intel Xeon host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained "
     "--seeds 20,21,22,23,24,25 --out results/agentic_vs_trl_seeds20-25_intel.json",
     "agentic_vs_trl_seeds20-25_intel.json", _agentic_vs_trl),
    ("Against TRL, guess game, held-out gain over twenty-four seeds (gains only: the runs come "
     "from several hosts and days)",
     "python benchmarks/agentic_results.py --out results/agentic_vs_trl_seeds0-23_pooled.json "
     "results/agentic_vs_trl.json results/agentic_vs_trl_seeds4-5.json "
     "results/agentic_vs_trl_seeds6-9.json results/agentic_vs_trl_seeds10-19_intel.json "
     "results/agentic_vs_trl_seeds20-25_intel.json",
     "agentic_vs_trl_seeds0-23_pooled.json", _agentic_gains),
    ("Against TRL, guess game: the same batches give the same update; the engine samples the "
     "policy it trains", "python benchmarks/agentic_update_check.py --steps 8 --seed 10",
     "agentic_update_check.json", _agentic_update_check),
    ("Against TRL, guess game, matched, each seed's two runs back to back (seeds 24-27 of an "
     "invocation for 24-33 stopped after seed 27, AMD EPYC host)",
     "python benchmarks/agentic_vs_trl.py --group-size 4 --constrained "
     "--seeds 24,25,26,27,28,29,30,31,32,33 --out results/agentic_vs_trl_seeds24-33_amd.json",
     "agentic_vs_trl_seeds24-33_amd.json", _agentic_vs_trl),
    ("Against TRL, guess game, held-out gain over twenty-eight seeds (gains only: the runs come "
     "from several hosts and days)",
     "python benchmarks/agentic_results.py --out results/agentic_vs_trl_seeds0-27_pooled.json "
     "results/agentic_vs_trl.json results/agentic_vs_trl_seeds4-5.json "
     "results/agentic_vs_trl_seeds6-9.json results/agentic_vs_trl_seeds10-19_intel.json "
     "results/agentic_vs_trl_seeds20-25_intel.json results/agentic_vs_trl_seeds24-33_amd.json",
     "agentic_vs_trl_seeds0-27_pooled.json", _agentic_gains),
    ("Against TRL, guess game: both sides' samplers against the base model's exact distribution",
     "python benchmarks/agentic_sampler_check.py", "agentic_sampler_check.json",
     _agentic_sampler_check),
    *[(f"Against TRL, guess game: rollart's sampler against the base model's exact "
       f"distribution, engine seed {k}",
       f"python benchmarks/agentic_sampler_check.py --frameworks rollart --seed {k} "
       f"--out results/agentic_sampler_check_rollart_seed{k}.json",
       f"agentic_sampler_check_rollart_seed{k}.json", _agentic_sampler_check)
      for k in range(1, 8)],
    ("Against TRL, guess game: rollart's sampler at later turns over engine seeds 1-7",
     "python benchmarks/agentic_sampler_check.py --pool "
     "results/agentic_sampler_check_rollart_seed{1,2,3,4,5,6,7}.json "
     "--out results/agentic_sampler_check_rollart_seeds1-7_pooled.json",
     "agentic_sampler_check_rollart_seeds1-7_pooled.json",
     lambda d: (f"{d['seeds']} engine seeds: surprise z {d['later_surprise_z']:+.2f} (p "
                f"{d['later_surprise_pvalue']:.2f}); draws at P < e^-5 "
                f"{d['rare_draws_observed']} (expected {d['rare_draws_expected']:.1f})")),
    ("Agentic base rates (SmolLM2-135M)", "python benchmarks/agentic_base_rate.py",
     "agentic_base_rate.json", _base_rate),
    ("Two agentic tasks in one run", "python benchmarks/agentic_multitask.py",
     "agentic_multitask.json", _multitask),
]
