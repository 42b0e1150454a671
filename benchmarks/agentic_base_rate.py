"""Base success rate of SmolLM2-135M-Instruct on the multi-turn agentic envs (guess, calculator).

RL can only show learning where the base policy sometimes succeeds and sometimes fails (GRPO's
group-normalised advantage is zero for a group that all succeeds or all fails), so each env's
default difficulty is tuned until this lands in 5-60 %. The episodes run through the project's
own rollout loop (`rollart.rollout.env_manager.run_episodes`: ChatML turns built in token space,
one batched `HFEngine.generate` per turn) with the task configs a run would use, so the numbers
are what iteration 0 of a training run would see.

Two modes per env: `free` (plain sampling, as `constrained: false`) and `constrained` (the run's
own path, `constrained: true` on the HF engine: `constrained_params`). For guess that is the
answer trie of every `<answer>K</answer>`; the calculator's turns (a call with any expression,
or any integer) are no finite list, so it samples under the token grammar of
`CalculatorEnv.action_grammar` (rollart/action_grammar.py).

Per env and mode: success rate, the share of turns with a format error (no strict format),
with a malformed action (nothing parsable) and with a tool call, mean turns, tokens, wall time
and a few example conversations; writes results/agentic_base_rate.json, prints one line.

    rollart models fetch smollm2-135m-instruct     # once
    .venv/bin/python benchmarks/agentic_base_rate.py [--episodes 32] [--modes free,constrained]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollart.config import ModelConfig, TaskConfig  # noqa: E402
from rollart.engines import HFEngine  # noqa: E402
from rollart.models import ChatFormat  # noqa: E402
from rollart.rollout.env_manager import EpisodeSpec, constrained_params, run_episodes  # noqa: E402
from rollart.types import SamplingParams, Trajectory  # noqa: E402

# The defaults a run config would use for each env (the env's own defaults for env_kwargs).
TASKS: dict[str, dict[str, Any]] = {
    "guess": {"env_id": "guess", "env_kwargs": {}, "max_turns": 6, "max_new_tokens": 24},
    "calculator": {"env_id": "calculator", "env_kwargs": {}, "max_turns": 3,
                   "max_new_tokens": 40},
}
STOP = ["</answer>", "</tool_call>"]  # a run's engine.stop must hold both for the calculator
CONSTRAINTS = {
    "none": "plain sampling (tasks[].constrained: false)",
    "answer_trie": "the run's own constrained path (tasks[].constrained: true, HF engine)",
    "token_grammar": "the run's own constrained path for an env with an action_grammar "
                     "(tasks[].constrained: true, HF engine walks the token grammar)",
}


def load(threads: int):
    """(model path, model, tokenizer), as a run with `model.source: hf_dir` loads them."""
    from rollart.models.fetch import fetch_model
    from rollart.models.policy import load_policy

    torch.set_num_threads(threads)
    path = fetch_model("smollm2-135m-instruct")["path"]
    model, tok = load_policy(ModelConfig(source="hf_dir", path=path), None, 0)
    model.eval()
    return path, model, tok


def task_params(task: TaskConfig, params: SamplingParams, chat: ChatFormat,
                constrained: bool) -> tuple[SamplingParams, str]:
    """(sampling params, how they constrain): the run's own path (`constrained_params`, with
    the HF engine's grammar walk): an answer trie where the env lists its actions, its token
    grammar where it has one instead."""
    task = task.model_copy(update={"constrained": constrained})
    p = constrained_params(params, chat, [task], grammar=True)[task.name]
    how = "token_grammar" if p.grammar else "answer_trie" if p.allowed_sequences else "none"
    return p, how


def summarise(trajs: list[Trajectory], wall_s: float, examples: int) -> dict[str, Any]:
    """Per-env numbers from the trajectories of one env."""
    turns = [t for x in trajs for t in x.turns]
    n_turns = max(len(turns), 1)
    return {
        "episodes": len(trajs),
        "success_rate": round(sum(x.success for x in trajs) / len(trajs), 4),
        "format_error_rate": round(sum(not t.format_ok for t in turns) / n_turns, 4),
        "malformed_action_rate": round(sum(t.action is None for t in turns) / n_turns, 4),
        "mean_turns": round(statistics.mean(x.num_turns for x in trajs), 3),
        "mean_env_return": round(statistics.mean(x.env_return for x in trajs), 4),
        "model_tokens_per_episode": round(statistics.mean(x.num_model_tokens for x in trajs), 1),
        "context_tokens_per_episode": round(statistics.mean(len(x.token_ids) for x in trajs), 1),
        "tool_call_turn_rate": round(
            sum((t.action or "").startswith("calculate(") for t in turns) / n_turns, 4),
        "terminated_rate": round(sum(x.terminated for x in trajs) / len(trajs), 4),
        "completion_tokens_per_turn": round(
            sum(t.completion_tokens for t in turns) / n_turns, 2),
        "env_errors": sum(x.error is not None for x in trajs),
        "wall_s": round(wall_s, 1),
        "examples": [{"seed": x.seed, "success": x.success,
                      "turns": [{"observation": t.observation, "response": t.response,
                                 "action": t.action, "reward": round(t.env_reward, 3)}
                                for t in x.turns]}
                     for x in trajs[:examples]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default="guess,calculator")
    ap.add_argument("--modes", default="free,constrained",
                    help="free: unconstrained sampling; constrained: under the answer grammar")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="per-turn cap for tasks that set none")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--seed-offset", type=int, default=1_000_000,
                    help="episode seeds start here (a run's evaluation seeds, by default)")
    ap.add_argument("--kwargs", default="{}",
                    help='JSON {env: env_kwargs} over the defaults, e.g. {"guess": {"high": 32}}')
    ap.add_argument("--max-turns", default="{}", help="JSON {env: max_turns}")
    ap.add_argument("--examples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/agentic_base_rate.json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    path, model, tok = load(args.threads)
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok, seed=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=1.0, stop=STOP)
    overrides, turns = json.loads(args.kwargs), json.loads(args.max_turns)
    results: dict[str, Any] = {}
    for name in [e for e in args.envs.split(",") if e]:
        spec = dict(TASKS[name])
        spec["env_kwargs"] = {**spec["env_kwargs"], **overrides.get(name, {})}
        spec["max_turns"] = int(turns.get(name, spec["max_turns"]))
        task = TaskConfig(name=name, format_penalty=-0.1, **spec)
        for mode in [m for m in args.modes.split(",") if m]:
            p, how = task_params(task, params, chat, mode == "constrained")
            specs = [EpisodeSpec(task, args.seed_offset + i, f"{name}/g{i}", f"{name}/m{i}")
                     for i in range(args.episodes)]
            t0 = time.perf_counter()
            trajs = run_episodes(specs, engine.generate, chat, {name: p},
                                 max_context=args.max_context)
            fields = {"env_id", "env_kwargs", "max_turns", "format_penalty", "parser",
                      "format_credit", "max_new_tokens"}
            results[f"{name}/{mode}"] = {
                "env": name, "mode": mode, "constraint": how, "constraint_means": CONSTRAINTS[how],
                "task": task.model_dump(include=fields),
                **summarise(trajs, time.perf_counter() - t0, args.examples)}
            r = results[f"{name}/{mode}"]
            print(f"{name}/{mode}: success {r['success_rate']:.2f}, {r['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
    result = {
        "model": "smollm2-135m-instruct", "model_path": path, "engine": "hf",
        "episodes": args.episodes, "temperature": args.temperature, "top_p": 1.0,
        "stop": STOP, "seed_offset": args.seed_offset, "runs": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": " ".join([".venv/bin/python benchmarks/agentic_base_rate.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "threads": args.threads},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    line = ", ".join(f"{key} {r['success_rate']:.2f} (format errors "
                     f"{r['format_error_rate']:.2f}, {r['mean_turns']:.1f} turns)"
                     for key, r in results.items())
    print(f"agentic base rate (SmolLM2-135M-Instruct, T={args.temperature}, {args.episodes} "
          f"episodes each, {result['wall_s']:.0f} s): success {line} -> {out}")


if __name__ == "__main__":
    main()
