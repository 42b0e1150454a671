"""rollart vs TRL 1.16's GRPOTrainer on a multi-turn agentic task: the guess env, SmolLM2-135M.

Both frameworks train SmolLM2-135M-Instruct (float32, `rollart models fetch
smollm2-135m-instruct`) on the same multi-turn episodes: guess a number 1..16 with
higher/lower feedback each turn, `<answer>K</answer>` actions, lenient parsing
(rollart/envs/guess.py), the env's system prompt and observations in the model's ChatML
template exactly as rollart's episode loop builds them (`benchmarks/agentic_episodes.py`, shared
by both sides), the same env seeds per step (rollart's own plan, `plan_iteration`), the same
reward (`env_outcome`), batch (`--groups` x `--group-size` episodes), per-turn token budget,
turns per episode, temperature, learning rate, loss (GRPO group advantage, PPO clip 0.2, token
mean per episode then mean over episodes, no KL / reference model, one optimizer step per
batch) and with observation tokens out of both losses. With `--constrained` both sample each
turn from the answer tokens only, the held-out evaluation too (`CONSTRAINED_NOTE`).

TRL runs in its own venv (`make peer`), through its experimental `rollout_func` (why that one,
with the source lines: `benchmarks/peer_trl_agentic.py`, and `mechanism` in the results file).
rollart runs as a user runs it: `rollart train --config configs/smollm2-guess.yaml --set ...`
(Prefect flow, embedded Dask cluster, the vLLM engine (`--engine`; prefix caching keeps each
conversation's KV cache between turns) on the H20 worker, trainer on H800).

One evaluator for every model: greedy play with rollart's episode loop and an HF engine in this
process, on held-out seeds (one per secret, all >= 1,000,000; no training seed reaches them),
before training and after each run. Accounting, the same on both sides (`Tally` over each run's
trajectories: rollart's stored shards, TRL's rollout_func): model tokens = generated tokens,
env steps = turns played; rates are over each run's whole wall time, start-up included.

    make peer && .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 \\
        --seeds 0,1,2,3 --constrained                          # -> results/agentic_vs_trl.json
    .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 --constrained \\
        --logprobs restricted --out results/agentic_vs_trl_restricted.json  # rollart's own loss
    .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 --constrained --lr 5e-6 \\
        --logprobs restricted --out results/agentic_vs_trl_lr5e-6.json  # ... at lr 5e-6
    .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 \\
        --out results/agentic_vs_trl_free.json                   # free sampling (lr 2e-5)
    .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 --constrained \\
        --frameworks rollart --resample-uniform 2 --seeds 0,1,2,3,4 \\
        --trl-from results/agentic_vs_trl.json,results/agentic_vs_trl_seeds4-5.json \\
        --out results/agentic_vs_trl_resample_seeds0-4.json  # rollart with dynamic sampling
    .venv/bin/python benchmarks/agentic_vs_trl.py --steps 2 --groups 1 --group-size 2 \\
        --seeds 0 --out /tmp/agentic_vs_trl_smoke.json                 # smoke run
    .venv/bin/python benchmarks/agentic_vs_trl.py --group-size 4 --lr 1e-12 --steps 10 --seeds 0 \\
        --out results/agentic_vs_trl_frozen.json    # throughput alone: one frozen policy
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.agentic_episodes import (  # noqa: E402
    Match,
    Tally,
    group_specs,
    guess_task,
    held_out_seeds,
    sampling,
    tally_rows,
)
from benchmarks.agentic_results import (  # noqa: E402
    earlier_trl_runs,
    final_state,
    host_facts,
    plays_plan,
    read_shards,
    rollart_signal,
    summarise,
    trl_signal,
)
from rollart.config import load_config  # noqa: E402
from rollart.rollout.plan import plan_iteration  # noqa: E402

CONFIG = ROOT / "configs/smollm2-guess.yaml"
PEER_PY = ROOT / ".venv-peer/bin/python"
PEER = ROOT / "benchmarks/peer_trl_agentic.py"

NOTES = [
    "Both sides play episodes with rollart's episode loop (run_episodes) and differ in "
    "generation (rollart: its engine, `rollart_engine`: vLLM keeps each conversation's KV "
    "cache between turns (prefix caching), HF re-encodes it; finished rows leave the batch; "
    "TRL: transformers generate as in GRPOTrainer._generate_single_turn, the whole conversation "
    "re-encoded each turn, finished rows decode padding until the batch's last row ends) and "
    "in training (rollart: the flow's trainer worker; TRL: GRPOTrainer).",
    "Model tokens are tokens that enter an episode (loss mask 1) on both sides; padding TRL "
    "decodes for finished rows is not counted.",
    "Held-out: greedy play against the guess env depends only on the secret, so one seed per "
    "secret (16) is the whole held-out distribution; secrets repeat between training and "
    "held-out seeds by construction (16 values), the seeds do not.",
    "TRL logs completions/clipped_ratio 1: each completion ends with chat glue (as rollart's "
    "trajectory does), not end-of-turn; mask_truncated_completions is False, so nothing is "
    "masked for it.",
    "rollart: algo.off_policy none (TRL has no behaviour correction without vLLM), "
    "algo.std_eps 1e-4 (TRL's constant); its first step includes warm-up and its last the "
    "final checkpoint's blocking save (checkpoint_s); TRL saves after its steps (save_s); the "
    "whole-run rates include all of it. The Prefect server is started by the first rollart run "
    "and reused by later ones, as a user's later runs reuse it.",
]

CONSTRAINED_NOTE = (
    "--constrained: both sides sample each turn from the answer tokens only (`<`, `answer`, "
    "`>`, `</`, the digits, end of turn: the task's `constrained: true` as a token bag, vLLM's "
    "`allowed_token_ids`; on TRL's side a logits processor on its `generate`), and so does the "
    "held-out evaluation. TRL's GRPOTrainer takes each token's log-probability over the whole "
    "vocabulary (it has no hook for a restriction); rollart's trainer does the same with "
    "--logprobs vocab (algo.constrained_logprobs, the default here), or under the bag the "
    "token was sampled from with --logprobs restricted (its own default); on-policy with one "
    "optimizer step per batch, both ratios start at 1.")


def rollart_overrides(m: Match, seed: int, model_dir: str, root: Path, threads: int,
                      engine: str, kv_cache_mb: int = 1024, staleness: int = 0,
                      engine_dtype: str = "float32",
                      constrained_logprobs: str = "restricted",
                      resample_uniform: int = 0, kv_block: int | None = None) -> list[str]:
    """Every matched setting pinned, whatever the config file says (another engineer owns it).
    `staleness` > 0 or a bf16 engine departs from TRL's on-policy fp32 sampling: rollart then
    corrects the sampling/training mismatch with truncated importance sampling (`tis`)."""
    exact = on_policy_fp32(staleness, engine_dtype)
    task = guess_task(m).model_dump()
    algo = {"advantage": "grpo", "normalize_std": True, "std_eps": m.std_eps,
            "loss": "ppo_clip", "clip_low": m.clip, "clip_high": m.clip, "dual_clip": None,
            "loss_agg": "seq_mean_token_mean", "kl_coef": 0.0, "entropy_coef": 0.0,
            # TRL has no behaviour correction without vLLM; rollart's "tis" weights would be
            # 1 within ~1e-6 here (synced weights), "none" makes the objectives identical.
            "off_policy": "none" if exact else "tis",
            # Under --constrained: "vocab" takes log-probs over the whole vocabulary, as TRL's
            # GRPOTrainer does; "restricted" under the bag each token was sampled from.
            # (tis compares with the engine's restricted log-probs: only under "restricted").
            "constrained_logprobs": constrained_logprobs if exact else "restricted"}
    return [f"seed={seed}", f"iterations={m.steps}", "model.source=hf_dir",
            f"model.path={model_dir}", "model.dtype=float32", f"engine.backend={engine}",
            f"engine.max_new_tokens={m.max_new_tokens}", f"engine.temperature={m.temperature}",
            f"engine.top_p={m.top_p}", f"engine.stop={json.dumps(list(m.stop))}",
            f"engine.max_batch_size={m.max_batch_size}", f"engine.threads={threads}",
            f"tasks={json.dumps([task])}", f"rollout.num_groups={m.groups}",
            f"rollout.group_size={m.group_size}", f"rollout.max_staleness={staleness}",
            "rollout.redundancy=0", f"rollout.resample_uniform={resample_uniform}",
            f"algo={json.dumps(algo)}", f"train.lr={m.lr}",
            "train.epochs=1", f"train.micro_batch_size={m.groups * m.group_size}",
            f"train.grad_clip={m.grad_clip}", "train.weight_decay=0.0", "train.max_kl=0.0",
            f"train.threads={threads}", "train.world_size=1", "reward.backend=local",
            "reward.function=env_outcome", "eval.episodes=0", "eval.before_training=false",
            f"storage.root={root}", f"storage.save_every={m.steps}", "storage.keep_last=1",
            f"engine.vllm.kv_cache_mb={kv_cache_mb}", f"engine.vllm.dtype={engine_dtype}",
            *([f"engine.vllm.block_size={kv_block}"] if kv_block else [])]


def on_policy_fp32(staleness: int, engine_dtype: str) -> bool:
    """rollart samples as TRL does (no staleness, float32 engine): no behaviour correction."""
    return staleness == 0 and engine_dtype == "float32"


def train_seeds(overrides: list[str], steps: int) -> list[list[int]]:
    """The env seed of each group of each step, from rollart's own plan of the run."""
    cfg = load_config(CONFIG, overrides)
    out = []
    for it in range(steps):
        specs = plan_iteration(cfg, it)
        out.append(list(dict.fromkeys(s.seed for s in specs)))
    return out


def load_model(path: str | Path, state: dict[str, torch.Tensor] | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)  # tied LM head restored through the tie
    return model.eval()


@torch.no_grad()
def evaluate(model: Any, tok: Any, m: Match, seeds: list[int]) -> dict[str, Any]:
    """Greedy held-out success: rollart's episode loop, an HF engine on `model` (the one
    evaluator for the base model and every framework's final model)."""
    from rollart.engines import HFEngine
    from rollart.models.chat import ChatFormat
    from rollart.rollout.env_manager import run_episodes

    t0 = time.perf_counter()
    engine = HFEngine(model, tok, seed=0, max_batch_size=m.max_batch_size)
    specs = group_specs(guess_task(m), seeds, 1, "eval")
    trajs = run_episodes(specs, engine.generate, ChatFormat(tok), sampling(m, tok, greedy=True),
                         m.max_context)
    t = Tally().add(trajs)
    return {"success_rate": t.successes / len(trajs), "success": [int(x.success) for x in trajs],
            "mean_turns": t.env_steps / len(trajs),
            "strict_format_rate": sum(u.format_ok for x in trajs for u in x.turns)
            / max(t.env_steps, 1), "eval_s": time.perf_counter() - t0}


def run_trl(m: Match, model_dir: str, data: Path, work: Path, seed: int, threads: int) -> dict:
    out, save = work / f"trl-{seed}.json", work / f"trl-{seed}-model"
    cmd = [str(PEER_PY), str(PEER), "--model", model_dir, "--data", str(data), "--seed",
           str(seed), "--threads", str(threads), "--out", str(out), "--save", str(save)]
    log = work / f"trl-{seed}.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"TRL seed {seed} failed (exit {rc}); log: {log}")
    res = json.loads(out.read_text())
    steps = res["steps"]
    return {"framework": "trl", "seed": seed, "wall_s": wall, "step_s": res["step_s"],
            "rollout_s": [s["rollout_s"] for s in steps],
            "training_s": [s - g for s, g in zip(res["step_s"], res["rollout_and_score_s"],
                                                 strict=False)],
            "startup_s": res["import_s"] + res["load_s"], "save_s": res["save_s"],
            "tally": {k: res[k] for k in ("episodes", "env_steps", "model_tokens", "successes")},
            "per_step": steps, "reward": res["reward"], "trl_config": res["trl_config"],
            "seeds_played": [s["seeds"][::m.group_size] for s in steps], "command": cmd,
            "model": str(save), **trl_signal(res, m.groups)}


def run_rollart(m: Match, overrides: list[str], work: Path, seed: int) -> dict:
    run_id = f"agentic-vs-trl-{seed}-{int(time.time())}"
    cmd = [str(ROOT / ".venv/bin/rollart"), "train", "--config", str(CONFIG), "--run-id", run_id]
    for s in overrides:
        cmd += ["--set", s]
    log = work / f"{run_id}.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"rollart seed {seed} failed (exit {rc}); log: {log}")
    run_dir = work / "artifacts/runs" / run_id
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("iteration", 0) >= 0 and "perf/iteration_s" in r]
    trained, played = read_shards(run_dir)
    # Episodes set aside (rollout.resample_uniform) were generated and played, never trained:
    # the rates count them as TRL's count every episode it generated.
    last = rows[-1] if rows else {}
    aside = int(last.get("rollout/groups_resampled", 0)) * m.group_size
    tally = Tally(trained.episodes + aside,
                  trained.env_steps + int(last.get("rollout/resampled_env_steps", 0)),
                  trained.model_tokens + int(last.get("rollout/resampled_model_tokens", 0)),
                  trained.successes)
    return {"framework": "rollart", "seed": seed, "wall_s": wall, "run_id": run_id,
            "step_s": [r["perf/iteration_s"] for r in rows],
            "rollout_s": [r.get("perf/rollout_s") for r in rows],
            "training_s": [r.get("perf/update_s") for r in rows],
            "sync_s": [r.get("perf/sync_s") for r in rows],
            "checkpoint_s": [r.get("perf/checkpoint_s", 0.0) for r in rows],
            "tally": vars(tally), "tally_trained": vars(trained),
            "tally_from_metrics": vars(tally_rows(rows)), "groups_resampled": aside // m.group_size,
            "reward": [r.get("reward/mean") for r in rows],
            "success_rate": [r.get("rollout/success_rate") for r in rows],
            "seeds_played": played, "command": cmd, "run_dir": str(run_dir),
            **rollart_signal(rows)}


def results_doc(a: argparse.Namespace, m: Match, host: dict[str, Any], seeds: list[int],
                held: list[int], base: dict[str, Any], probe: Path, runs: list[dict[str, Any]],
                trl_from: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file: settings, host, the summary over `runs` so far, and the runs."""
    mech = json.loads(probe.read_text()) if probe.exists() else None
    return {"benchmark": "agentic_vs_trl", "command": " ".join([sys.executable, *sys.argv]),
            "complete": False,
            "host": {**host, "loadavg_end": Path("/proc/loadavg").read_text().split()[:3]},
            "model": "SmolLM2-135M-Instruct (float32)", "settings": m.to_json(),
            "run_seeds": seeds, "rollart_engine": a.engine,
            "rollart_kv_block": a.kv_block or "engine default (32 on CPU)",
            # what rollart's loss took: restricted whenever tis corrects the sampling
            "rollart_constrained_logprobs": (
                (a.logprobs if on_policy_fp32(a.staleness, a.engine_dtype) else "restricted")
                if m.constrained else None),
            "rollart_config": str(CONFIG.relative_to(ROOT)),
            "held_out_seeds": held, "base_success": base["success_rate"], "base": base,
            **summarise(runs, base["success_rate"], seeds), "mechanism": mech,
            "resample_uniform": a.resample_uniform, "trl_runs_from": trl_from,
            "notes": NOTES + ([CONSTRAINED_NOTE] if m.constrained else []),
            "runs": runs}


def write(doc: dict[str, Any], path: str) -> None:
    """Replace `path` whole (a reader never sees half a file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=2, help="prompts (env seeds) per step")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per prompt")
    ap.add_argument("--seeds", default="0,1", help="run seeds, one run per framework each")
    ap.add_argument("--lr", type=float, default=Match.lr,
                    help="both sides; 1e-12 freezes the policy (float32 weights do not move), "
                         "so both generate from the same model: a throughput-only run")
    ap.add_argument("--constrained", action="store_true",
                    help="both sides sample only answer-turn tokens (the task's constrained: "
                         "true, as a token bag), the held-out evaluation too")
    ap.add_argument("--logprobs", default="vocab", choices=["vocab", "restricted"],
                    help="--constrained: rollart's algo.constrained_logprobs (vocab: over the "
                         "whole vocabulary, as TRL's loss; restricted: under the bag)")
    ap.add_argument("--frameworks", default="trl,rollart")
    ap.add_argument("--engine", default="vllm", choices=["hf", "vllm"], help="rollart's engine")
    ap.add_argument("--kv-cache-mb", type=int, default=1024,
                    help="vLLM's KV cache (16 episodes of 6 turns need ~1 GiB)")
    ap.add_argument("--kv-block", type=int, default=None,
                    help="rollart's engine.vllm.block_size (default: the engine's, 32 on CPU)")
    ap.add_argument("--staleness", type=int, default=0, help="rollart's rollout.max_staleness")
    ap.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="rollart's vLLM weights (the trainer stays float32)")
    ap.add_argument("--resample-uniform", type=int, default=0,
                    help="rollart's rollout.resample_uniform (dynamic sampling; TRL has none)")
    ap.add_argument("--trl-from", default="",
                    help="comma-separated results files whose TRL runs stand for this run's "
                         "(same settings; TRL's runs are deterministic): with --frameworks "
                         "rollart, the ratios compare against them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results/agentic_vs_trl.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    frameworks = [f for f in a.frameworks.split(",") if f]
    if "trl" in frameworks and not PEER_PY.exists():
        sys.exit("TRL's venv is missing: run `make peer` first (.venv-peer, trl==1.16.0)")
    if not CONFIG.exists():
        sys.exit(f"{CONFIG} is missing (the guess run config this benchmark overrides)")
    from transformers import AutoTokenizer

    from rollart.models.fetch import fetch_model

    host = host_facts()  # the commit that runs (the tree may change while this runs)
    m = Match(steps=a.steps, groups=a.groups, group_size=a.group_size, lr=a.lr,
              constrained=a.constrained)
    seeds = [int(s) for s in a.seeds.split(",") if s]
    model_dir = fetch_model("smollm2-135m-instruct")["path"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="rollart-agentic-vs-trl-"))
    held = held_out_seeds(m)
    probe = work / "probe.json"
    if "trl" in frameworks:  # not timed: which mechanism, and what environment_factory says
        done = subprocess.run([str(PEER_PY), str(PEER), "--probe", "--model", model_dir,
                               "--out", str(probe)], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{done.stderr[-2000:]}\nthe TRL peer does not start (an older .venv-peer "
                     "without gymnasium?): run `make peer`")
    base = evaluate(load_model(model_dir), tok, m, held)
    print(f"base greedy success {base['success_rate']:.3f} on {len(held)} held-out seeds",
          flush=True)
    runs: list[dict[str, Any]] = []
    try:
        for i, seed in enumerate(seeds):
            overrides = rollart_overrides(m, seed, model_dir, work / "artifacts", a.threads,
                                          a.engine, a.kv_cache_mb, a.staleness,
                                          a.engine_dtype, a.logprobs, a.resample_uniform,
                                          a.kv_block)
            planned = train_seeds(overrides, m.steps)
            data = work / f"data-{seed}.json"
            data.write_text(json.dumps({"match": m.to_json(), "train_seeds": planned}))
            order = frameworks if i % 2 == 0 else frameworks[::-1]  # alternate who goes first
            for fw in order:
                if fw == "trl":
                    res = run_trl(m, model_dir, data, work, seed, a.threads)
                    model = load_model(res["model"])
                else:
                    res = run_rollart(m, overrides, work, seed)
                    model = load_model(model_dir, final_state(res["run_dir"]))
                res["seeds_match_plan"] = (plays_plan(res["seeds_played"], planned)
                                           if fw == "rollart" else res["seeds_played"] == planned)
                res["held_out"] = evaluate(model, tok, m, held)
                runs.append(res)
                print(f"seed {seed} {fw}: {statistics.median(res['step_s']):.1f} s/step, "
                      f"wall {res['wall_s']:.0f} s, {res['tally']['model_tokens']} tokens, "
                      f"{res['tally']['env_steps']} env steps, held-out "
                      f"{res['held_out']['success_rate']:.3f}", flush=True)
                # an interrupted invocation keeps the runs it finished ("complete": false)
                write(results_doc(a, m, host, seeds, held, base, probe, runs, []), a.out)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    trl_from = earlier_trl_runs(a.trl_from, m, held, seeds, runs)
    out = {**results_doc(a, m, host, seeds, held, base, probe, runs, trl_from), "complete": True}
    write(out, a.out)
    print(f"agentic_vs_trl: success gain rollart {out['rollart_success_gain']} vs TRL "
          f"{out['trl_success_gain']}; tokens/s ratio {out['tokens_per_s_ratio']}, env steps/s "
          f"ratio {out['env_steps_per_s_ratio']}; step_s {out['step_s']} -> {a.out}")


if __name__ == "__main__":
    main()
