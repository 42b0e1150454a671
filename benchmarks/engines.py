"""HF engine vs vLLM engine on the same model and the same batch: tokens/s and log-prob agreement.

Both engines serve the same float32 weights; the batch is `--requests` chat prompts of the
arithmetic task (ChatML, the policy's own chat format), sampled at `--temperature` for up to
`--max-new-tokens` tokens (eos and `</answer>` end a row early, as in training). Each engine gets
one warm-up call, then `--repeats` rounds in which HF and vLLM serve the same batch back to
back; tokens/s = generated tokens / wall seconds per call, median over rounds, and
`vllm_over_hf` is the median of the per-round ratios (the machine is shared: adjacent calls see
similar load). The trainer (rollart.train.trainer.Trainer) then recomputes the log-prob of every
generated token from the full sequence, and `logprob_mae_*` is the mean |engine - trainer| over
generated tokens (the `train/logprob_mismatch` a run would report at staleness 0).

`--model smollm2` (default) uses the directory from `rollart models fetch smollm2-135m-instruct`
(fetched if missing); `--model tiny` the 2-layer config-built Llama of the default config.
Both engines use `--threads` torch threads. Writes results/engines.json and
prints one summary line.

    .venv/bin/python benchmarks/engines.py [--model smollm2|tiny] [--requests 16]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollart.config import AlgoConfig, TaskConfig, TinyModelConfig, TrainConfig  # noqa: E402
from rollart.engines import HFEngine  # noqa: E402
from rollart.envs import make_env  # noqa: E402
from rollart.models import ChatFormat, build_tiny_model, build_tokenizer  # noqa: E402
from rollart.train.trainer import Trainer, collate  # noqa: E402
from rollart.types import GenerationRequest, SamplingParams, Trajectory  # noqa: E402


def load_model(name: str):
    """(model dir or None, model, tokenizer)."""
    if name == "tiny":
        env = make_env(TaskConfig(name="a", env_id="arith", env_kwargs={}))
        tok = build_tokenizer(env.corpus_texts(200), 320)
        return None, build_tiny_model(TinyModelConfig(), tok, 0), tok
    from rollart.config import ModelConfig
    from rollart.models.fetch import fetch_model
    from rollart.models.policy import load_policy

    path = fetch_model("smollm2-135m-instruct")["path"]
    model, tok = load_policy(ModelConfig(source="hf_dir", path=path), None, 0)
    return path, model, tok


def make_requests(tok, n: int, params: SamplingParams, tag: str) -> list[GenerationRequest]:
    chat, env = ChatFormat(tok), make_env(TaskConfig(name="a", env_id="arith", env_kwargs={}))
    out = []
    for i in range(n):
        obs, _ = env.reset(seed=i)
        ids = chat.first_prompt(env.system_prompt, obs)
        out.append(GenerationRequest(f"{tag}{i}", ids, params))
    return out


def timed_rounds(engines: dict, tok, n: int, params: SamplingParams,
                 repeats: int) -> tuple[dict, dict]:
    """Warm each engine up, then `repeats` rounds in which every engine serves the same batch
    back to back. Others share this machine, so per-round ratios (adjacent in time) and the
    median are reported rather than one long run per engine."""
    for eng in engines.values():
        eng.generate(make_requests(tok, n, params, "warm"))
    calls: dict[str, list[dict]] = {name: [] for name in engines}
    pairs: dict[str, list] = {}
    for r in range(repeats):
        for name, eng in engines.items():
            reqs = make_requests(tok, n, params, f"r{r}-")
            t0 = time.perf_counter()
            comps = eng.generate(reqs)
            wall = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for c in comps)
            calls[name].append({"tokens": tokens, "wall_s": round(wall, 3),
                                "tokens_per_s": round(tokens / wall, 1)})
            pairs[name] = list(zip(reqs, comps, strict=True))
    stats = {}
    for name, cs in calls.items():
        tps = sorted(c["tokens_per_s"] for c in cs)
        stats[name] = {"calls": cs, "tokens_per_s": statistics.median(tps), "best": tps[-1],
                       "torch_threads": torch.get_num_threads()}
    return stats, pairs


def logprob_mae(trainer: Trainer, pairs: list, pad_id: int) -> float:
    """Mean |engine - trainer| log-prob over generated tokens."""
    trajs = []
    for req, c in pairs:
        n, k = len(req.prompt_ids), len(c.token_ids)
        trajs.append(Trajectory(
            sample_id=req.request_id, task="a", env_id="arith", group_id="g", seed=0,
            iteration=0, token_ids=req.prompt_ids + c.token_ids, loss_mask=[0] * n + [1] * k,
            behaviour_logprobs=[0.0] * n + c.logprobs, token_versions=[-1] * n + [0] * k))
    batch = collate(trajs, pad_id)
    diffs = []
    for lo in range(0, len(batch), 4):  # micro-batches bound the [B, T, V] logits memory
        mb = batch.select(slice(lo, lo + 4))
        prox = trainer._logprobs(trainer.model, mb)
        diffs.append(((prox - mb.behaviour_logprobs).abs() * mb.loss_mask).sum())
    return float(sum(diffs) / batch.loss_mask.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-dtype", default="float32",
                    help="vLLM weights/compute dtype (bfloat16: faster on CPUs with AVX512-BF16 "
                         "or AMX, at the price of a larger log-prob gap to the float32 trainer)")
    ap.add_argument("--out", default="results/engines.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, model, tok = load_model(args.model)
    model.eval()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            stop=["</answer>"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = Trainer(model, AlgoConfig(), TrainConfig(), temperature=args.temperature,
                      pad_id=int(pad))
    model.eval()

    hf = HFEngine(model, tok, seed=0)
    from rollart.engines.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    if path:
        vllm = VLLMEngine(path, tok, seed=0, max_model_len=1024, kv_cache_mb=256,
                          dtype=args.vllm_dtype)
    else:
        vllm = VLLMEngine.from_model(model, tok, seed=0, kv_cache_mb=64, dtype=args.vllm_dtype)
    init_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    vllm.update_weights(0, {k: v for k, v in model.state_dict().items()})  # the sync path
    stats, pairs = timed_rounds({"hf": hf, "vllm": vllm}, tok, args.requests, params,
                                args.repeats)
    vllm.close()
    hf_stats, v_stats = stats["hf"], stats["vllm"]
    hf_stats["logprob_mae"] = logprob_mae(trainer, pairs["hf"], int(pad))
    v_stats["logprob_mae"] = logprob_mae(trainer, pairs["vllm"], int(pad))
    v_stats["init_s"] = round(init_s, 1)
    ratio = statistics.median(v["tokens_per_s"] / h["tokens_per_s"]
                              for h, v in zip(hf_stats["calls"], v_stats["calls"], strict=True))
    result = {
        "model": args.model, "model_path": path, "requests": args.requests,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "repeats": args.repeats, "vllm_dtype": args.vllm_dtype, "hf": hf_stats, "vllm": v_stats,
        "vllm_over_hf": round(ratio, 3),
        "logprob_mae_hf": hf_stats["logprob_mae"], "logprob_mae_vllm": v_stats["logprob_mae"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"engines ({args.model}, {args.requests} req x <= {args.max_new_tokens} tok): "
          f"HF {hf_stats['tokens_per_s']:.1f} tok/s, vLLM {v_stats['tokens_per_s']:.1f} tok/s, "
          f"vllm_over_hf {ratio:.2f}; |logprob - trainer| HF {hf_stats['logprob_mae']:.2e}, "
          f"vLLM {v_stats['logprob_mae']:.2e} -> {out}")


if __name__ == "__main__":  # vLLM may spawn worker processes: keep the guard
    main()
