"""rollart vs TRL's GRPOTrainer: same model, task, batch, token budget, learning rate and steps.

Model: SmolLM2-135M-Instruct, float32 (`rollart models fetch smollm2-135m-instruct`). Task: the
arithmetic env of `configs/smollm2-arith.yaml` (sums of two numbers in 1..20); both frameworks
get the same chat-formatted prompt text and the same reward (rollart's `math` verifier + the
env's format penalty). Batch: `--prompts` prompts x `--group` samples, at most
`--max-new-tokens` new tokens, temperature 1.0, top-p 1, generation ends at the model's end of
turn only (no stop string for either), one optimizer step per batch, no reference model,
constant learning rate `--lr`, `--steps` steps.

Runs interleave in one invocation (round r: TRL, then every rollart variant), so adjacent runs
see the same machine. TRL runs in the peer venv (`make peer`: .venv-peer); rollart runs as a
user runs it, `rollart train --config configs/smollm2-arith.yaml --set ...` (Prefect flow, Dask
workers per hardware class, rewards through the local Lambda endpoint). Per run: s/step (median
over steps; rollart `perf/iteration_s` less the final checkpoint's blocking save, as TRL saves
after its steps; TRL a callback's step time), generation and training
time, generated tokens/s, reward; the final model is then evaluated greedily on `--eval`
held-out problems (none of them in TRL's training set) by one evaluator for every framework.

    make peer && .venv/bin/python benchmarks/vs_trl.py          # -> results/vs_trl.json

`speedup_vs_trl` = TRL's median s/step over the best rollart variant's (steps per second
ratio); `token_throughput_ratio` = the same variant's generated tokens per second of step time
over TRL's (per round, median): answers shorten as a policy learns, at a pace of each
framework's own, and steps/s counts that too. `--variants` picks rollart variants
(sync/async x vllm/hf).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from rollart.config import load_config  # noqa: E402
from rollart.envs import make_env  # noqa: E402

CONFIG = ROOT / "configs/smollm2-arith.yaml"
PEER_PY = ROOT / ".venv-peer/bin/python"
# Asynchronous runs overlap generation of batch k+1 with update k, so the trainer and the
# engine each get a core of their own (cluster.cpu_cores; rollart/cpu_pinning.py): two
# 2-thread OpenMP pools on 2 shared cores stall each other (vs_trl.json at 3e18c51, unpinned:
# async 48.9 s/step vs sync 27.6).
_OWN_CORES = ['cluster.cpu_cores={"H800": "1", "H20": "0"}', "train.threads=1",
              "engine.threads=1"]
VARIANTS = {  # name -> rollart overrides on top of the shared batch settings
    "sync-vllm": ["engine.backend=vllm", "rollout.max_staleness=0"],
    "async-vllm": ["engine.backend=vllm", "rollout.max_staleness=1", *_OWN_CORES],
    "sync-hf": ["engine.backend=hf", "rollout.max_staleness=0"],
    "async-hf": ["engine.backend=hf", "rollout.max_staleness=1", *_OWN_CORES],
}


def problems(env: Any, seeds: range, exclude: set[str]) -> list[dict[str, Any]]:
    out, seen = [], set(exclude)
    for s in seeds:
        text, answer = env.generate(s)
        if text not in seen:
            seen.add(text)
            out.append({"seed": s, "problem": text, "answer": str(answer)})
    return out


def render(tok: Any, env: Any, problem: str) -> str:
    """The prompt text rollart's episode loop builds (system, user, assistant header)."""
    msgs = [{"role": "system", "content": env.system_prompt},
            {"role": "user", "content": f"Compute {problem}."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def greedy_accuracy(model: Any, tok: Any, env: Any, rows: list[dict[str, Any]],
                    max_new_tokens: int, batch: int = 32) -> float:
    """Share of `rows` answered correctly under greedy decoding (same evaluator for all)."""
    tok.padding_side = "left"
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        enc = tok([r["prompt"] for r in part], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
        for r, ids in zip(part, out[:, enc["input_ids"].shape[1]:], strict=True):
            env.reset(r["seed"])
            correct += bool(env.verify(tok.decode(ids, skip_special_tokens=True))[0])
    return correct / len(rows)


def load_model(path: str | Path, state: dict[str, torch.Tensor] | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)  # tied LM head restored through the tie
    return model


def run_trl(a: argparse.Namespace, model_dir: str, data: Path, work: Path, r: int) -> dict:
    out, save = work / f"trl-{r}.json", work / f"trl-{r}-model"
    t0 = time.perf_counter()
    subprocess.run([str(PEER_PY), str(ROOT / "benchmarks/peer_trl.py"), "--model", model_dir,
                    "--data", str(data), "--steps", str(a.steps), "--prompts-per-step",
                    str(a.prompts), "--group-size", str(a.group), "--max-new-tokens",
                    str(a.max_new_tokens), "--lr", str(a.lr), "--threads", "2", "--seed",
                    str(r), "--out", str(out), "--save", str(save)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    steps, gen = res["step_s"], res["generation_s"]
    tokens = res["completion_tokens"]
    return {"framework": "trl", "round": r, "wall_s": time.perf_counter() - t0,
            "step_s": steps, "median_step_s": statistics.median(steps),
            "generation_s": statistics.median(gen),
            "training_s": statistics.median(s - g for s, g in zip(steps, gen, strict=False)),
            "tokens_per_s": sum(tokens) / max(sum(gen), 1e-9),
            "completion_tokens": tokens, "step_tokens_per_s": sum(tokens) / sum(steps),
            "reward": res["reward"], "model": str(save)}


def run_rollart(a: argparse.Namespace, variant: str, work: Path, r: int) -> dict:
    run_id = f"vs-trl-{variant}-{r}-{int(time.time())}"
    sets = [f"iterations={a.steps}", f"rollout.num_groups={a.prompts}",
            f"rollout.group_size={a.group}", f"engine.max_new_tokens={a.max_new_tokens}",
            "engine.temperature=1.0", "engine.top_p=1.0", "engine.stop=[]", f"train.lr={a.lr}",
            "train.epochs=1", f"train.micro_batch_size={a.prompts * a.group}",
            "eval.episodes=0", f"storage.save_every={a.steps}", f"seed={r}",
            f"storage.root={work / 'artifacts'}", *VARIANTS[variant]]
    cmd = [str(ROOT / ".venv/bin/rollart"), "train", "--config", str(CONFIG), "--run-id", run_id]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    log = work / f"{run_id}.log"
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"rollart {variant} failed (exit {rc}); log: {log}")
    run_dir = work / "artifacts/runs" / run_id
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def med(key: str) -> float:
        vals = [m[key] for m in rows if key in m]
        return statistics.median(vals) if vals else float("nan")

    # TRL saves its model after its last step, outside the step times; rollart's last
    # iteration waits for the final checkpoint's blocking save (`perf/checkpoint_s`, ~5-10 s
    # for weights + optimizer state): that save is taken out of the step time, for parity.
    # `iteration_s` keeps the raw times.
    steps = [m["perf/iteration_s"] - m.get("perf/checkpoint_s", 0.0) for m in rows]
    tokens = sum(m.get("rollout/model_tokens", 0.0) for m in rows)
    busy = rows[-1].get("perf/engine_busy_s", 0.0)  # cumulative; async overlaps the rollout wait
    return {"framework": "rollart", "variant": variant, "round": r,
            "wall_s": time.perf_counter() - t0, "run_id": run_id,
            "step_s": steps, "median_step_s": statistics.median(steps),
            "iteration_s": [m["perf/iteration_s"] for m in rows],
            "median_iteration_s": med("perf/iteration_s"), "generation_s": med("perf/rollout_s"),
            "training_s": med("perf/update_s"), "sync_s": med("perf/sync_s"),
            "sync_bytes": med("perf/sync_bytes"), "orchestration_s": med("perf/orchestration_s"),
            "update_tokens_per_s": med("perf/update_tokens_per_s"),
            "tokens_per_s": tokens / max(busy, 1e-9),
            "completion_tokens": [m.get("rollout/model_tokens", 0.0) for m in rows],
            "step_tokens_per_s": tokens / sum(steps),
            "reward": [m.get("reward/mean") for m in rows], "run_dir": str(run_dir)}


def final_state(run_dir: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    ckpts = sorted(Path(run_dir, "checkpoints").glob("*/model.safetensors"))
    if not ckpts:
        sys.exit(f"no checkpoint under {run_dir}/checkpoints")
    return safetensors.torch.load(ckpts[-1].read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-5)  # configs/smollm2-arith.yaml
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--eval", type=int, default=64, help="held-out problems (greedy)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "results/vs_trl.json"))
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        sys.exit(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    if not PEER_PY.exists():
        sys.exit("TRL's venv is missing: run `make peer` first (.venv-peer, trl==1.16.0)")
    from transformers import AutoTokenizer

    from rollart.models.fetch import fetch_model

    commit = _commit()  # what runs (the tree may change while the benchmark runs)
    model_dir = fetch_model("smollm2-135m-instruct")["path"]
    cfg = load_config(CONFIG)
    env = make_env(cfg.tasks[0])
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = problems(env, range(0, 10_000), set())[: a.steps * a.prompts]
    held = problems(env, range(500_000, 600_000), {p["problem"] for p in train})[: a.eval]
    for row in train + held:
        row["prompt"] = render(tok, env, row["problem"])
    work = Path(tempfile.mkdtemp(prefix="rollart-vs-trl-"))
    data = work / "problems.json"
    data.write_text(json.dumps({"train": train, "held_out": held}))
    torch.set_num_threads(2)
    base_acc = greedy_accuracy(load_model(model_dir), tok, env, held, a.max_new_tokens)
    print(f"base greedy accuracy {base_acc:.3f} on {len(held)} held-out problems", flush=True)
    runs: list[dict[str, Any]] = []
    try:
        for r in range(a.rounds):
            res = run_trl(a, model_dir, data, work, r)
            res["final_accuracy"] = greedy_accuracy(load_model(res.pop("model")), tok, env,
                                                    held, a.max_new_tokens)
            runs.append(res)
            print(f"round {r} trl: {res['median_step_s']:.1f} s/step, "
                  f"accuracy {res['final_accuracy']:.3f}", flush=True)
            for v in variants:
                res = run_rollart(a, v, work, r)
                state = final_state(res["run_dir"])
                res["final_accuracy"] = greedy_accuracy(load_model(model_dir, state), tok, env,
                                                        held, a.max_new_tokens)
                runs.append(res)
                print(f"round {r} rollart {v}: {res['median_step_s']:.1f} s/step "
                      f"(sync {res['sync_s']:.2f} s), accuracy {res['final_accuracy']:.3f}",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarise(runs, variants)
    out = {"benchmark": "vs_trl", "args": vars(a), "host": platform.node(),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "model": "SmolLM2-135M-Instruct (float32)", "base_accuracy": base_acc,
           "held_out": len(held), "commit": commit, **summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"vs_trl: speedup_vs_trl {summary['speedup_vs_trl']:.2f}x ({summary['best_variant']}"
          f", {summary['rollart_step_s']:.1f} vs TRL {summary['trl_step_s']:.1f} s/step); "
          f"tokens/s of step time {summary['token_throughput_ratio']:.2f}x; "
          f"sync {summary['sync_s']:.2f} s; accuracy rollart "
          f"{summary['rollart_final_accuracy']:.3f} vs TRL {summary['trl_final_accuracy']:.3f}"
          f" (base {base_acc:.3f}) -> {a.out}")


def summarise(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    trl = [x for x in runs if x["framework"] == "trl"]
    trl_step = statistics.median(x["median_step_s"] for x in trl)
    per: dict[str, dict[str, float]] = {}
    for v in variants:
        mine = [x for x in runs if x.get("variant") == v]
        step = statistics.median(x["median_step_s"] for x in mine)
        ratios = [t["median_step_s"] / x["median_step_s"] for t, x in zip(trl, mine, strict=True)]
        # Generated tokens per second of step time (all steps): the steps/s ratio also counts
        # answers getting shorter as a policy learns, at a pace that differs per framework.
        tok = [x["step_tokens_per_s"] / t["step_tokens_per_s"]
               for t, x in zip(trl, mine, strict=True)]
        per[v] = {"step_s": step, "speedup": trl_step / step,
                  "speedup_min": min(ratios), "speedup_max": max(ratios),
                  "token_throughput_ratio": statistics.median(tok),
                  "token_throughput_ratio_min": min(tok), "token_throughput_ratio_max": max(tok),
                  "sync_s": statistics.median(x["sync_s"] for x in mine),
                  "final_accuracy": statistics.mean(x["final_accuracy"] for x in mine)}
    best = min(per, key=lambda v: per[v]["step_s"])
    return {"trl_step_s": trl_step, "variants": per, "best_variant": best,
            "rollart_step_s": per[best]["step_s"], "speedup_vs_trl": per[best]["speedup"],
            "sync_s": per[best]["sync_s"],
            "token_throughput_ratio": per[best]["token_throughput_ratio"],
            "trl_final_accuracy": statistics.mean(x["final_accuracy"] for x in trl),
            "rollart_final_accuracy": per[best]["final_accuracy"]}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    main()
