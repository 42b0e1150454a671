"""Does rollart learn the guess task as TRL would from the same samples? Three checks.

agentic_vs_trl.py matches the two frameworks' settings; this checks that the matched settings
give the same learning step, with each side's own code, on batches a real run produced.

1. **The run's engine samples the policy it trains.** A `rollart train` run with the
   comparison's settings (`agentic_vs_trl.rollart_overrides`: vLLM engine, constrained
   sampling, on-policy) except `algo.constrained_logprobs: restricted`, so the trainer takes its
   log-probs under the same token bag and temperature as the engine's: each update's
   `train/logprob_mismatch` (mean |trainer - engine| log-prob of the sampled tokens) is then 0
   up to float32 rounding when the engine holds the trainer's weights, and `train/staleness_max`
   is 0 when every token came from the latest version.
2. **The run trained exactly its stored batches.** A fresh `Trainer` built as the flow's
   trainer service builds it (the run's own config.yaml) replays the run's stored trajectories,
   iteration by iteration; its weights must equal the run's final checkpoint.
3. **rollart's update is TRL's.** The same stored batches go through rollart's `Trainer` with
   the comparison's loss settings (`constrained_logprobs: vocab`, as TRL's loss) and through
   TRL 1.16's `GRPOTrainer` with the comparison's `GRPOConfig` (peer venv,
   `benchmarks/peer_trl_replay.py`; its rollout_func returns each recorded batch and TRL computes
   advantages, loss and AdamW step itself), from the same weights. Compared: each step's
   gradient norm, the gradient of the first step with signal, and the weights after the last
   step, relative to how far the weights moved.
4. **The engine's samples follow the policy's distribution**, not only its reported
   log-probs: rollart's vLLM engine holding the run's final weights samples `--samples`
   answers to each of `--prompts` turn prompts of the run; each sampled token's randomized
   probability integral transform under the exact distribution (the HF model with the same
   weights) must look uniform, and the mean surprise of the sampled tokens must match the
   distribution's entropy (`sampler_calibration`). This is the sampler TRL's side does not
   share (it samples with transformers' `generate`); agentic_sampler_check.py puts both
   samplers to the same test at the base model.

Tolerances (`TOLERANCE`): both sides compute in float32 with different summation orders
(~1e-6 relative per reduction). AdamW's first steps move every weight by ~lr whatever its
gradient's size, so a component whose tiny gradient flips sign between the two sums moves the
other way; that lifts the weight comparison to ~1e-4 of the weight change. A small change
of the objective moves the gradient far more: the results file's
`gradient_rel_diff_other_objectives` gives rollart's gradient against TRL's with a token mean
over the batch instead of per episode, and with every loss mask one token late
(`objective_controls`). Check 4 fails at a p-value below 0.01 on either test (a 1 %
false alarm rate each); with ~5,000 tokens the KS test detects a distance from uniform of
~0.02, and the surprise test a sampler whose temperature is a few percent off.

    make peer && .venv/bin/python benchmarks/agentic_update_check.py --steps 8 --seed 10
        # -> results/agentic_update_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from benchmarks.agentic_episodes import Match, trl_sample  # noqa: E402
from benchmarks.agentic_results import final_state, host_facts  # noqa: E402
from benchmarks.agentic_vs_trl import PEER_PY, rollart_overrides, run_rollart  # noqa: E402
from rollart.config import RunConfig, load_config  # noqa: E402
from rollart.types import SamplingParams, Trajectory  # noqa: E402

PEER = ROOT / "benchmarks/peer_trl_replay.py"
TOLERANCE = {"logprob_mismatch": 1e-3, "checkpoint_rel_diff": 1e-3,
             "gradient_rel_diff": 1e-3, "weights_rel_diff": 1e-3,
             "pvalue": 0.01}
Weights = dict[str, torch.Tensor]
# Calibration counts draws of tokens the exact distribution gives less than e^-5 (~0.7 %):
# where a flatter sampler's excess shows first.
RARE_LOGP = -5.0


def stored_batches(run_dir: Path) -> list[list[Trajectory]]:
    """Each iteration's stored trajectories, groups consecutive (as TRL lays a batch out)."""
    import pyarrow.parquet as pq

    from rollart.types import table_to_trajectories

    out = []
    for f in sorted((run_dir / "trajectories").glob("*/*.parquet")):
        trajs = table_to_trajectories(pq.read_table(f))
        out.append(sorted(trajs, key=lambda t: (t.group_id, t.sample_id)))
    return out


def engine_on_policy(run_dir: Path) -> dict[str, Any]:
    """Check 1 from the run's metrics: the mismatch of every update that had signal."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("iteration", -1) >= 0 and "train/staleness_max" in r]
    gaps = [r.get("train/logprob_mismatch") for r in rows]
    worst = max((g for g in gaps if g is not None), default=None)
    return {"logprob_mismatch": gaps, "logprob_mismatch_max": worst,
            "staleness_max": max(r["train/staleness_max"] for r in rows),
            "updates_without_signal": sum(g is None for g in gaps)}


def replay(cfg: RunConfig, batches: list[list[Trajectory]],
           grad_step: int | None = None) -> tuple[torch.nn.Module, list[dict[str, float]],
                                                 Weights | None]:
    """A fresh trainer as the flow's trainer service builds it (rollart/services/trainer.py),
    through `batches` in order: (model, each update's metrics, the gradient of update
    `grad_step` (1-based) as the optimizer stepped it, after clipping)."""
    from rollart.action_grammar import token_texts
    from rollart.models.policy import load_policy
    from rollart.train.trainer import Trainer

    torch.manual_seed(cfg.seed)
    model, tok = load_policy(cfg.model, None, cfg.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = Trainer(model, cfg.algo, cfg.train, temperature=cfg.engine.temperature,
                      pad_id=int(pad), token_texts=token_texts(tok))
    metrics, grads = [], None
    for k, trajs in enumerate(batches, 1):
        metrics.append(trainer.update(trajs))
        if k == grad_step:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return model, metrics, grads


def turn_prompts(batches: list[list[Trajectory]], limit: int) -> list[list[int]]:
    """Distinct prompts the run's episodes sent to the engine: each conversation up to the
    first generated token of each turn (where the loss mask turns on), at most `limit`."""
    seen: dict[tuple[int, ...], None] = {}
    for t in (t for b in batches for t in b):
        for i in range(1, len(t.loss_mask)):
            if t.loss_mask[i] and not t.loss_mask[i - 1]:
                seen.setdefault(tuple(t.token_ids[:i]))
    return [list(p) for p in list(seen)[:limit]]


def sampler_calibration(model_dir: str, state: Weights, prompts: list[list[int]],
                        samples: int, m: Match, seed: int) -> dict[str, Any]:
    """Check 4: rollart's vLLM engine, holding `state`, samples `samples` answers to each
    prompt under the task's bag at its temperature (`engine_answers`); `calibration` scores
    them against the exact distribution (an HF model with `state`)."""
    from transformers import AutoTokenizer

    from benchmarks.agentic_episodes import sampling

    params = sampling(m, AutoTokenizer.from_pretrained(model_dir))["guess"]
    answers, reported = engine_answers(model_dir, state, prompts, [samples] * len(prompts),
                                       params, seed, batch=64)
    model = load_base(model_dir)
    model.load_state_dict(state, strict=False)  # the tied head follows the embeddings
    return calibration(model, prompts, answers, params, seed, reported)


def engine_answers(model_dir: str, state: Weights | None, prompts: list[list[int]],
                   counts: list[int], params: SamplingParams, seed: int,
                   batch: int) -> tuple[list[list[list[int]]], list[list[list[float]]]]:
    """rollart's vLLM engine (holding `state`, or the base weights) samples `counts[i]`
    answers to prompt i with `params` (the task's bag, temperature and stop), `batch` requests
    per generate call: ([prompt][sample] -> token ids, the same -> the log-probs the engine
    reports for them: of the distribution it drew each token from, bag and T applied)."""
    from transformers import AutoTokenizer

    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.types import GenerationRequest

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(model_dir, tok, seed=seed, eos_token_ids=[tok.eos_token_id],
                        kv_cache_mb=512)
    try:
        if state is not None:
            engine.update_weights(1, state)
        reqs = [GenerationRequest(f"p{i}/s{j}", p, params)
                for i, (p, n) in enumerate(zip(prompts, counts, strict=True))
                for j in range(n)]
        comps = [c for k in range(0, len(reqs), batch)
                 for c in engine.generate(reqs[k:k + batch])]
    finally:
        engine.close()
    out: list[list[list[int]]] = [[] for _ in prompts]
    lps: list[list[list[float]]] = [[] for _ in prompts]
    for c in comps:
        i = int(c.request_id.split("/")[0][1:])
        out[i].append(list(c.token_ids))
        lps[i].append(list(c.logprobs))
    return out, lps


def calibration(model: torch.nn.Module, prompts: list[list[int]],
                answers: list[list[list[int]]], params: SamplingParams,
                seed: int, reported: list[list[list[float]]] | None = None) -> dict[str, Any]:
    """How far sampled `answers` [prompt][sample] lie from `model`'s exact distribution under
    the task's bag at its temperature: each sampled token's randomized probability integral
    transform u = P(token' < token) + U * P(token) (softmax of the bag's logits / T, given the
    prompt and the answer so far). Exact sampling makes the u i.i.d. uniform (Rosenblatt),
    whatever the policy: the Kolmogorov-Smirnov distance from uniform and its p-value say how
    far the samples are from the policy's distribution; the surprise score (`surprise_terms`)
    says whether they are sharper or flatter than it. With the sampler's `reported` log-probs
    of its tokens: the largest gap from the exact ones (a departure there lies in the
    distribution it drew from; none there, in the draw itself)."""
    bag = torch.tensor(sorted(params.allowed_token_ids or []))
    gen = torch.Generator().manual_seed(seed)
    us: list[float] = []
    score, var = 0.0, 0.0
    outside = 0  # sampled tokens outside the bag: 0 if the sampler honours the restriction
    gap = 0.0  # max |reported - exact log-prob| of a sampled token
    rare, rare_expected = 0, 0.0  # draws of tokens with P < e^RARE_LOGP: observed, expected
    for k, (prompt, sampled_answers) in enumerate(zip(prompts, answers, strict=True)):
        for j, (p, sampled) in enumerate(zip(
                answer_probs(model, prompt, sampled_answers, bag, params.temperature),
                sampled_answers, strict=True)):
            ids = torch.tensor(sampled)
            at = torch.searchsorted(bag, ids).clamp(max=len(bag) - 1)  # [answer tokens]
            outside += int((bag[at] != ids).sum())
            drawn = p.gather(1, at[:, None])[:, 0]  # [answer tokens] exact P(drawn token)
            rare += int((drawn < math.exp(RARE_LOGP)).sum())
            rare_expected += float((p * (p < math.exp(RARE_LOGP))).sum())
            if reported is not None and len(sampled):  # an empty answer: nothing to compare
                told = torch.tensor(reported[k][j], dtype=torch.float64)
                gap = max(gap, float((told - drawn.log()).abs().max()))
            noise = torch.rand(len(sampled), generator=gen, dtype=torch.float64)
            us += pit_values(p, at, noise).tolist()
            s_, v_ = surprise_terms(p, at)
            score, var = score + s_, var + v_
    ks, pvalue = ks_uniform(us)
    z = score / math.sqrt(var) if var > 0 else 0.0
    return {"prompts": len(prompts), "samples_per_prompt": max(map(len, answers), default=0),
            "tokens": len(us), "tokens_outside_bag": outside, "ks_distance": ks,
            "ks_pvalue": pvalue, "surprise_z": z,
            "surprise_pvalue": math.erfc(abs(z) / math.sqrt(2)),
            "rare_draws": {"logp_below": RARE_LOGP, "observed": rare,
                           "expected": rare_expected},
            **({"reported_logprob_max_gap": gap} if reported is not None else {})}


@torch.no_grad()
def answer_probs(model: torch.nn.Module, prompt: list[int], answers: list[list[int]],
                 bag: torch.Tensor, temperature: float) -> list[torch.Tensor]:
    """The exact sampling distribution [answer tokens, bag] at each token of each answer to
    `prompt`: softmax of the bag's logits / T. One forward for all answers, the prompt run once
    (the trainer's shared-prefix forward, rollart/train/shared_prefix.py)."""
    from rollart.train.shared_prefix import shared_prefix_hidden

    n, plen = len(answers), len(prompt)
    width = plen + max(len(a) for a in answers)
    ids = torch.zeros(n, width, dtype=torch.long)  # [n, T], right-padded
    wanted = torch.zeros(n, width - 1, dtype=torch.long)  # [n, T-1]: position j predicts j+1
    for b, a in enumerate(answers):
        ids[b, :plen + len(a)] = torch.tensor(prompt + a)
        wanted[b, plen - 1:plen - 1 + len(a)] = 1
    hidden = shared_prefix_hidden(model.model, ids, wanted, ["prompt"] * n)  # [n, T, H]
    out = []
    for b, a in enumerate(answers):
        z = model.lm_head(hidden[b, plen - 1:plen - 1 + len(a)])[:, bag] / temperature
        out.append(torch.softmax(z.double(), -1))
    return out


def pit_values(probs: torch.Tensor, slots: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Randomized probability integral transform [n] of the outcomes `slots` [n] drawn from the
    categorical rows `probs` [n, k], with `noise` [n] ~ U(0, 1): P(slot' < slot) + noise *
    P(slot). Uniform on (0, 1) when each outcome was drawn from its row."""
    mass = probs.gather(1, slots[:, None])[:, 0]  # [n] P(outcome)
    below = torch.cumsum(probs, -1).gather(1, slots[:, None])[:, 0] - mass  # [n]
    return below + noise * mass


def surprise_terms(probs: torch.Tensor, slots: torch.Tensor) -> tuple[float, float]:
    """(sum over rows of log P(outcome) + entropy, sum of their variances) for outcomes `slots`
    [n] drawn from the rows `probs` [n, k]. Each term has mean 0 and the given variance when
    drawn exactly, so sum / sqrt(variance) is ~N(0, 1): the score test for a sampling
    temperature (a sharper sampler draws likelier tokens: positive; a flatter one: negative),
    where the integral transform's KS distance is weak."""
    logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))  # [n, k], 0 at p = 0
    entropy = -(probs * logp).sum(-1)  # [n]
    second = (probs * logp * logp).sum(-1)  # [n] E[(log p)^2]
    drawn = logp.gather(1, slots[:, None])[:, 0]  # [n]
    return float((drawn + entropy).sum()), float((second - entropy * entropy).sum())


def ks_uniform(us: list[float]) -> tuple[float, float]:
    """Kolmogorov-Smirnov distance of `us` from Uniform(0, 1) and its asymptotic p-value."""
    xs, n = sorted(us), len(us)
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(xs))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


def rel_diff(a: Weights, b: Weights, ref: Weights | None = None) -> float:
    """|a - b| / |b - ref| over every tensor of b (|b| without `ref`)."""
    num = sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in b)
    den = sum(float(((b[k] - (ref[k] if ref else 0)).double() ** 2).sum()) for k in b)
    return math.sqrt(num / den) if den else float("inf")


def max_abs(a: Weights, b: Weights) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def params(model: torch.nn.Module) -> Weights:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_base(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def trl_replay(m: Match, model_dir: str, batches: list[list[Trajectory]], seed: int,
               grad_step: int, work: Path, threads: int) -> tuple[Weights, Weights, list[dict]]:
    """Check 3's TRL side, in the peer venv: (final weights, gradient of `grad_step`, steps)."""
    data = work / "batches.json"
    steps = [[{**trl_sample(t), "reward": float(t.reward or 0.0)} for t in b] for b in batches]
    data.write_text(json.dumps({"match": m.to_json(), "steps": steps}))
    out = work / "trl"
    done = subprocess.run([str(PEER_PY), str(PEER), "--model", model_dir, "--batches",
                           str(data), "--seed", str(seed), "--threads", str(threads),
                           "--grad-step", str(grad_step), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{done.stderr[-3000:]}\nTRL's replay failed (run `make peer` first)")
    return (safetensors.torch.load_file(str(out / "final.safetensors")),
            safetensors.torch.load_file(str(out / "grad.safetensors")),
            json.loads((out / "steps.json").read_text()))


def objective_controls(run_dir: Path, batches: list[list[Trajectory]],
                       trl_grad: Weights) -> dict[str, float]:
    """How far rollart's gradient of the last of `batches` lands from TRL's when the objective
    differs a little: the tolerance's yardstick. A token mean over the whole batch instead of
    per episode (`loss_agg: token_mean`, TRL's "bnpo"), and every loss mask one token late."""
    vocab = "algo.constrained_logprobs=vocab"
    k = len(batches)
    _, _, agg = replay(load_config(run_dir / "config.yaml", [vocab, "algo.loss_agg=token_mean"]),
                       batches, grad_step=k)
    late = [[dataclasses.replace(t, loss_mask=[0, *t.loss_mask[:-1]]) for t in b]
            for b in batches]
    _, _, shifted = replay(load_config(run_dir / "config.yaml", [vocab]), late, grad_step=k)
    assert agg is not None and shifted is not None
    return {"token_mean_over_batch": rel_diff(agg, trl_grad),
            "loss_mask_one_token_late": rel_diff(shifted, trl_grad)}


def update_vs_trl(m: Match, run_dir: Path, model_dir: str, batches: list[list[Trajectory]],
                  seed: int, work: Path, threads: int, base: Weights) -> dict[str, Any]:
    """Check 3: rollart's Trainer (TRL's loss settings) and TRL's GRPOTrainer, same batches."""
    cfg = load_config(run_dir / "config.yaml", ["algo.constrained_logprobs=vocab"])
    signal = [k for k, b in enumerate(batches, 1) if any(t.advantage for t in b)]
    if not signal:
        sys.exit("no stored batch has a learning signal: run more --steps")
    model, metrics, grad = replay(cfg, batches, grad_step=signal[0])
    assert grad is not None
    trl_w, trl_grad, trl_steps = trl_replay(m, model_dir, batches, seed, signal[0], work,
                                            threads)
    ours = params(model)
    del model
    controls = objective_controls(run_dir, batches[:signal[0]], trl_grad)
    norms = [(float(r.get("train/grad_norm", 0.0)), s["grad_norm"])
             for r, s in zip(metrics, trl_steps, strict=True)]
    return {"steps": [{"rollart_grad_norm": a, "trl_grad_norm": b,
                       "no_signal": bool(r.get("train/no_signal", 0.0))}
                      for (a, b), r in zip(norms, metrics, strict=True)],
            "grad_norm_max_rel_diff": max(abs(a - b) / b for a, b in norms if b > 0),
            "gradient_step": signal[0], "gradient_rel_diff": rel_diff(grad, trl_grad),
            "gradient_rel_diff_other_objectives": controls,
            "weights_rel_diff": rel_diff(ours, trl_w, base),
            "weights_max_abs_diff": max_abs(ours, trl_w),
            "weight_change_norm": math.sqrt(sum(float(((trl_w[k] - base[k]).double() ** 2)
                                                      .sum()) for k in trl_w)),
            "lr": m.lr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=40, help="check 4: distinct turn prompts")
    ap.add_argument("--samples", type=int, default=50, help="check 4: answers per prompt")
    ap.add_argument("--out", default=str(ROOT / "results/agentic_update_check.json"))
    a = ap.parse_args()
    if not PEER_PY.exists():
        sys.exit("TRL's venv is missing: run `make peer` first (.venv-peer, trl==1.16.0)")
    from rollart.models.fetch import fetch_model

    host = host_facts()
    torch.set_num_threads(a.threads)
    m = Match(steps=a.steps, groups=2, group_size=4, constrained=True)
    model_dir = fetch_model("smollm2-135m-instruct")["path"]
    work = Path(tempfile.mkdtemp(prefix="rollart-update-check-"))
    try:
        t0 = time.perf_counter()
        overrides = rollart_overrides(m, a.seed, model_dir, work / "artifacts", a.threads,
                                      "vllm", constrained_logprobs="restricted")
        run = run_rollart(m, overrides, work, a.seed)
        run_dir = Path(run["run_dir"])
        batches = stored_batches(run_dir)
        engine = engine_on_policy(run_dir)
        model, _, _ = replay(load_config(run_dir / "config.yaml", []), batches)
        base = params(load_base(model_dir))
        ckpt = final_state(str(run_dir))
        replayed, saved = params(model), {k: ckpt[k] for k in base}
        checkpoint = {"rel_diff": rel_diff(replayed, saved, base),
                      "max_abs_diff": max_abs(replayed, saved)}
        del replayed
        del model
        update = update_vs_trl(m, run_dir, model_dir, batches, a.seed, work, a.threads, base)
        sampler = sampler_calibration(model_dir, ckpt, turn_prompts(batches, a.prompts),
                                      a.samples, m, a.seed)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    worst = engine["logprob_mismatch_max"]  # None: no update had signal, nothing compared
    agree = {"engine_on_policy": worst is not None and worst <= TOLERANCE["logprob_mismatch"]
             and engine["staleness_max"] == 0,
             "checkpoint_is_replay": checkpoint["rel_diff"] <= TOLERANCE["checkpoint_rel_diff"],
             "update_is_trl": update["gradient_rel_diff"] <= TOLERANCE["gradient_rel_diff"]
             and update["weights_rel_diff"] <= TOLERANCE["weights_rel_diff"],
             "engine_samples_policy": sampler["tokens_outside_bag"] == 0
             and min(sampler["ks_pvalue"], sampler["surprise_pvalue"]) >= TOLERANCE["pvalue"]}
    doc = {"benchmark": "agentic_update_check", "host": host, "settings": m.to_json(),
           "seed": a.seed, "run_command": run["command"], "engine": engine,
           "checkpoint_replay": checkpoint, "update_vs_trl": update,
           "sampler_calibration": sampler, "tolerance": TOLERANCE,
           "agree": agree, "wall_s": wall}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"agentic_update_check: engine logprob mismatch max {engine['logprob_mismatch_max']}"
          f", staleness max {engine['staleness_max']}; checkpoint vs replay "
          f"{checkpoint['rel_diff']:.1e}; update vs TRL: gradient {update['gradient_rel_diff']:.1e}"
          f", weights {update['weights_rel_diff']:.1e} of the change; sampler KS "
          f"{sampler['ks_distance']:.3f} (p {sampler['ks_pvalue']:.2f}), surprise z "
          f"{sampler['surprise_z']:.2f} over {sampler['tokens']} tokens; agree {agree} -> {a.out}")


if __name__ == "__main__":
    main()
