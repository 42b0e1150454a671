"""Do both sides of agentic_vs_trl.py sample the policy they start from? Both samplers, one test.

agentic_update_check.py checks rollart's vLLM engine at one trained policy. A seed's course is
set by its first samples (a policy whose groups answer alike early gets no gradient), so this
checks both samplers where every run starts, at the base model:

- **Prompts:** the turn prompts of `--episodes` base-policy episodes (rollart's episode loop and
  HF engine, sampled at the task's temperature; seeds from `--prompt-seed`). The first is the
  opening every episode shares (system prompt and "Guess the secret number"), sampled
  `--first` times; each later-turn prompt `--samples` times.
- **rollart's sampler:** its vLLM engine as a run builds it (`agentic_update_check.engine_answers`).
- **TRL's sampler:** the comparison's generation path, inside a `GRPOTrainer` built with its
  `GRPOConfig` (`benchmarks/peer_trl_sampler.py`, peer venv).
- **Calibration** (`agentic_update_check.calibration`): each sampled token's randomized
  probability integral transform under the exact distribution (the HF model: softmax of the
  bag's logits / T) is uniform when sampling is exact (Kolmogorov-Smirnov), and the tokens'
  mean surprise matches the distribution's entropy (score z), for the opening and for later
  turns apart.
- **Where a departure lies:** rollart's engine reports the log-probability of each token it
  drew (bag and temperature applied, as a run's trainer receives it). Its largest gap from the
  exact one (`reported_logprob_max_gap`) near 0 means the engine drew from the exact
  distribution, and a calibration departure would lie in the draw itself.
- **Independence:** the opening's answers taken `--group` at a time, in the order the
  sampler returned them (a GRPO group's first turn, as one generate call holds it): the share
  of equal pairs within those groups against its permutation distribution
  (`group_collisions`); and the same for the answers at one position of consecutive generate
  calls (`same_position_pairs`: a random stream that restarted with each call, or each
  iteration, would repeat them). Samples drawn independently make every pair alike in law.

`agree` per sampler: every p-value >= 0.01 and no token outside the bag.

    make peer && .venv/bin/python benchmarks/agentic_sampler_check.py
        # -> results/agentic_sampler_check.json; --frameworks rollart: rollart's sampler only
    .venv/bin/python benchmarks/agentic_sampler_check.py --pool results/FILE... --out OUT
        # the later turns over several engine seeds' files (`pooled`)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.agentic_episodes import Match, group_specs, guess_task, sampling  # noqa: E402
from benchmarks.agentic_results import host_facts  # noqa: E402
from benchmarks.agentic_update_check import (  # noqa: E402
    calibration,
    engine_answers,
    load_base,
    turn_prompts,
)
from benchmarks.agentic_vs_trl import PEER_PY  # noqa: E402
from rollart.types import SamplingParams  # noqa: E402

PEER = ROOT / "benchmarks/peer_trl_sampler.py"
PVALUE = 0.01


def group_collisions(answers: list[list[int]], group: int, perms: int,
                     seed: int) -> dict[str, Any]:
    """Equal pairs within consecutive groups of `group` answers, against the same count after
    shuffling the answers `perms` times (one-sided: samples that share randomness agree more
    often). The p-value is (1 + shuffles at least as high) / (1 + perms)."""
    keys = [tuple(a) for a in answers]
    n = len(keys) - len(keys) % group

    def within(ks: list[tuple[int, ...]]) -> int:
        return sum(ks[g + i] == ks[g + j] for g in range(0, n, group)
                   for i in range(group) for j in range(i + 1, group))

    observed = within(keys[:n])
    rng, pool, higher = random.Random(seed), keys[:n], 0
    for _ in range(perms):
        rng.shuffle(pool)
        higher += within(pool) >= observed
    pairs = n // group * group * (group - 1) // 2
    every = sum(c * (c - 1) // 2 for c in Counter(keys[:n]).values()) / (n * (n - 1) // 2)
    return {"groups": n // group, "pairs": pairs, "equal_pairs": observed,
            "equal_pair_rate": observed / pairs if pairs else 0.0,
            "equal_pair_rate_all_pairs": every, "pvalue": (1 + higher) / (1 + perms)}


def same_position_pairs(answers: list[list[int]], call: int) -> list[list[int]]:
    """The answers at the same position of consecutive generate calls of `call` answers each
    (calls 0 and 1, 2 and 3, ...), as consecutive pairs: `group_collisions(pairs, 2, ...)`
    then asks whether a sampler's random stream repeats from one call to the next."""
    out = []
    for c in range(0, len(answers) // call - 1, 2):
        for i in range(call):
            out += [answers[c * call + i], answers[(c + 1) * call + i]]
    return out


def base_prompts(model: torch.nn.Module, tok: Any, m: Match, episodes: int,
                 seed: int) -> list[list[int]]:
    """The turn prompts of `episodes` episodes of `model` (sampled; it is not changed), the
    shared opening first."""
    from rollart.engines import HFEngine
    from rollart.models.chat import ChatFormat
    from rollart.rollout.env_manager import run_episodes

    engine = HFEngine(model, tok, seed=seed, max_batch_size=m.max_batch_size)
    specs = group_specs(guess_task(m), list(range(seed, seed + episodes)), 1, "prompts")
    trajs = run_episodes(specs, engine.generate, ChatFormat(tok), sampling(m, tok),
                         m.max_context)
    return turn_prompts([trajs], 10_000)


def trl_answers(m: Match, model_dir: str, prompts: list[list[int]], counts: list[int],
                seed: int, threads: int, work: Path) -> dict[str, Any]:
    data, out = work / "prompts.json", work / "trl-answers.json"
    data.write_text(json.dumps({"match": m.to_json(), "prompts": prompts, "counts": counts}))
    done = subprocess.run([str(PEER_PY), str(PEER), "--model", model_dir, "--data", str(data),
                           "--seed", str(seed), "--threads", str(threads), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{done.stderr[-3000:]}\nTRL's sampler failed (run `make peer` first)")
    return json.loads(out.read_text())


def judge(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[list[int]]],
          m: Match, tok: Any, params: SamplingParams, seed: int, group: int,
          reported: list[list[list[float]]] | None = None) -> dict[str, Any]:
    """One sampler's calibration (opening, later turns) and independence within groups;
    with the log-probs it `reported` for its tokens, their largest gap from the exact ones."""
    opening = calibration(model, prompts[:1], answers[:1], params, seed,
                          reported[:1] if reported else None)
    later = calibration(model, prompts[1:], answers[1:], params, seed,
                        reported[1:] if reported else None)
    groups = group_collisions(answers[0], group, 2000, seed)
    calls = group_collisions(same_position_pairs(answers[0], m.max_batch_size), 2, 2000, seed)
    first = Counter(tok.decode(a) for a in answers[0]).most_common(10)
    ps = [opening["ks_pvalue"], opening["surprise_pvalue"], later["ks_pvalue"],
          later["surprise_pvalue"], groups["pvalue"], calls["pvalue"]]
    return {"opening": opening, "later_turns": later, "within_group": groups,
            "across_calls": calls,
            "opening_answers_top": first,
            "mean_answer_tokens": sum(map(len, (x for a in answers for x in a)))
            / sum(map(len, answers)),
            "agree": min(ps) >= PVALUE
            and opening["tokens_outside_bag"] + later["tokens_outside_bag"] == 0}


def pooled(docs: list[dict[str, Any]], side: str = "rollart_vllm") -> dict[str, Any]:
    """One sampler's later turns over independent engine seeds (one results file each): the
    seeds' surprise z summed over sqrt(seeds) (Stouffer: ~N(0, 1) when every seed samples
    exactly) and the rare draws summed."""
    later = [d[side]["later_turns"] for d in docs]
    z = sum(t["surprise_z"] for t in later) / math.sqrt(len(later))
    return {"sampler": side, "seeds": len(later), "later_surprise_z": z,
            "later_surprise_pvalue": math.erfc(abs(z) / math.sqrt(2)),
            "rare_draws_observed": sum(t["rare_draws"]["observed"] for t in later),
            "rare_draws_expected": sum(t["rare_draws"]["expected"] for t in later)}


def pool_main(files: list[str], out: str) -> None:
    doc = {"benchmark": "agentic_sampler_check_pooled", "command": [sys.executable, *sys.argv],
           "files": files, **pooled([json.loads(Path(f).read_text()) for f in files])}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"agentic_sampler_check pooled over {len(files)} engine seeds: later-turn z "
          f"{doc['later_surprise_z']:+.2f} (p {doc['later_surprise_pvalue']:.2f}), rare draws "
          f"{doc['rare_draws_observed']} (expected {doc['rare_draws_expected']:.1f}) -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="base-policy episodes for prompts")
    ap.add_argument("--prompt-seed", type=int, default=100)
    ap.add_argument("--first", type=int, default=400, help="samples of the shared opening")
    ap.add_argument("--samples", type=int, default=25, help="samples of each later prompt")
    ap.add_argument("--group", type=int, default=4, help="GRPO group size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frameworks", default="rollart,trl", help="rollart, trl or both")
    ap.add_argument("--out", default=str(ROOT / "results/agentic_sampler_check.json"))
    ap.add_argument("--pool", nargs="+", metavar="FILE",
                    help="no sampling: pool these results files (one engine seed each) -> --out")
    a = ap.parse_args()
    if a.pool:
        return pool_main(a.pool, a.out)
    frameworks = a.frameworks.split(",")
    if not set(frameworks) <= {"rollart", "trl"}:
        sys.exit(f"--frameworks: rollart and/or trl, not {a.frameworks!r}")
    if "trl" in frameworks and not PEER_PY.exists():
        sys.exit("TRL's venv is missing: run `make peer` first (.venv-peer, trl==1.16.0)")
    from transformers import AutoTokenizer

    from rollart.models.fetch import fetch_model

    torch.set_num_threads(a.threads)
    host = host_facts()
    m = Match(groups=2, group_size=a.group, constrained=True)
    model_dir = fetch_model("smollm2-135m-instruct")["path"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = Path(tempfile.mkdtemp(prefix="rollart-sampler-check-"))
    t0 = time.perf_counter()
    try:
        model = load_base(model_dir)  # the prompts' episodes, then the exact distribution
        prompts = base_prompts(model, tok, m, a.episodes, a.prompt_seed)
        counts = [a.first] + [a.samples] * (len(prompts) - 1)
        params = sampling(m, tok)["guess"]
        drawn: dict[str, dict[str, Any]] = {}
        if "rollart" in frameworks:
            t = time.perf_counter()
            ours, told = engine_answers(model_dir, None, prompts, counts, params, a.seed,
                                        batch=m.max_batch_size)
            drawn["rollart_vllm"] = {"answers": ours, "reported": told,
                                     "sample_s": time.perf_counter() - t}
        if "trl" in frameworks:
            trl = trl_answers(m, model_dir, prompts, counts, a.seed, a.threads, work)
            drawn["trl_generate"] = {"answers": trl["answers"], "sample_s": trl["generate_s"],
                                     "generation_config": trl["generation_config"]}
        sides = {k: {**judge(model, prompts, v.pop("answers"), m, tok, params, a.seed,
                             a.group, v.pop("reported", None)), **v}
                 for k, v in drawn.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "agentic_sampler_check", "command": [sys.executable, *sys.argv],
           "host": host, "settings": m.to_json(), "policy": "base", "prompts": len(prompts),
           "samples": counts, "pvalue_threshold": PVALUE, **sides,
           "agree": {k: v["agree"] for k, v in sides.items()},
           "wall_s": time.perf_counter() - t0}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    line = "; ".join(
        f"{k}: opening KS p {v['opening']['ks_pvalue']:.2f} z {v['opening']['surprise_z']:+.2f}"
        f", later KS p {v['later_turns']['ks_pvalue']:.2f} z "
        f"{v['later_turns']['surprise_z']:+.2f}, within-group p "
        f"{v['within_group']['pvalue']:.2f}, across calls p {v['across_calls']['pvalue']:.2f}"
        for k, v in sides.items())
    print(f"agentic_sampler_check ({len(prompts)} prompts): {line}; agree {doc['agree']} -> "
          f"{a.out}")


if __name__ == "__main__":
    main()
