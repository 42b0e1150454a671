"""GPU check: the sharded trainer over nccl, the vLLM GPU engine and the weight stream, on
whatever GPUs this machine has. Writes results/gpu_check.json and prints one summary line.

    .venv/bin/python benchmarks/gpu_check.py [--parts env,fsdp,vllm,sync] [--out FILE]

Needs a CUDA build of torch (and of vLLM for the engine part); the CPU venv of this project has
neither, so on a GPU machine install them first (`pip install torch vllm` in a venv of its own
with this checkout installed). Each part reports ok / skipped (with the reason) / failed (with
the error), so the file says what was and was not checked:

- env:  torch and CUDA versions, the GPUs.
- fsdp: 2 trainer ranks (one per GPU, nccl) against 1 on the same batch (tiny Llama,
        `rollart.train.rank_check`): parameters within the float reduction-order bound
        2 * 1.003 * lr * updates; then the same 2 ranks with bf16 mixed precision (finite loss
        and gradient norm). Needs 2 GPUs (nccl refuses two ranks on one).
- vllm: the vLLM engine on a GPU over a tiny model: generation with per-token log-probs, a
        weight update, generation under the new version.
- sync: the weight stream from GPU tensors through a chain of 2 receivers (exact bytes).
        Runs without a GPU too (from CPU tensors): that is how this script is tested.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PARTS = ("env", "fsdp", "vllm", "sync")
ADAM_RATIO = 1.003  # max |m_hat / sqrt(v_hat)| over AdamW's first 3 steps (sharded_trainer.py)


class Skip(Exception):
    """A part this machine cannot run (no GPU, one GPU, no vLLM build for it)."""


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def part_env() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "gpus": gpus()}
    if gpus():
        out["names"] = [torch.cuda.get_device_name(i) for i in range(gpus())]
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def part_fsdp(tmp: Path) -> dict[str, Any]:
    if gpus() < 2:
        raise Skip(f"{gpus()} GPU(s): nccl needs one GPU per rank, 2 ranks")
    import safetensors.torch

    from rollart.train.rank_check import launch

    kw = dict(model="tiny", updates=3, rows=12, lr=1e-3, micro=4, max_len=60, seed=0)
    launch(1, tmp / "w1", **kw)  # one rank: unsharded, on the CPU
    launch(2, tmp / "w2", **kw)  # two ranks: nccl, one GPU each
    a, b = (safetensors.torch.load_file(str(tmp / d / "params.safetensors"))
            for d in ("w1", "w2"))
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    bound = 2 * ADAM_RATIO * kw["lr"] * kw["updates"]
    launch(2, tmp / "bf16", mixed_precision=1, **kw)
    m = json.loads((tmp / "bf16" / "metrics.json").read_text())["metrics"]
    finite = all(torch.isfinite(torch.tensor([x["train/loss"], x["train/grad_norm"]])).all()
                 for x in m)
    if diff > bound or not finite:
        raise AssertionError(f"parity {diff:.2e} (bound {bound:.1e}), bf16 finite {finite}")
    return {"parity_max_abs": diff, "bound": bound, "bf16_finite": finite,
            "bf16_loss": [x["train/loss"] for x in m]}


def part_vllm() -> dict[str, Any]:
    if not gpus():
        raise Skip("no CUDA device (the CPU engine is covered by tests/unit/test_engine_vllm.py)")
    try:
        from vllm.platforms import current_platform
    except ImportError as err:
        raise Skip(f"vllm not importable: {err}") from None
    if current_platform.is_cpu():
        raise Skip("the installed vLLM is a CPU build")
    from rollart.config import TinyModelConfig
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.policy import build_tiny_model
    from rollart.models.tokenizer import build_tokenizer
    from rollart.types import GenerationRequest, SamplingParams

    tok = build_tokenizer(["go left", "go right", "<answer>Left</answer>"] * 20, 320)
    model = build_tiny_model(TinyModelConfig(), tok, 0)  # head_dim 32
    engine = VLLMEngine.from_model(model, tok, seed=0, dtype="float32",
                                   gpu_memory_utilization=0.3)
    try:
        req = [GenerationRequest(f"r{i}", tok.encode("go left"), SamplingParams(
            max_new_tokens=8, temperature=1.0)) for i in range(4)]
        first = engine.generate(req)
        state = {k: v + 0.01 for k, v in model.state_dict().items()}
        engine.update_weights(1, state)
        second = engine.generate(req)
        ok = (all(len(c.logprobs) == len(c.token_ids) > 0 for c in first + second)
              and all(c.weight_version == 1 for c in second))
        if not ok:
            raise AssertionError("completions without log-probs or on the old version")
        return {"tokens": sum(len(c.token_ids) for c in first + second),
                "versions": sorted({c.weight_version for c in second})}
    finally:
        engine.close()


def part_sync() -> dict[str, Any]:
    from rollart.engines.weight_stream import WeightReceiver, send_weights

    device = "cuda" if gpus() else "cpu"
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 257, generator=g).to(device) for i in range(6)}
    state["bf16"] = torch.randn(33, 7, generator=g).to(torch.bfloat16).to(device)
    token = secrets.token_bytes(32)
    rxs = [WeightReceiver("127.0.0.1", token, 30.0) for _ in range(2)]
    try:
        sent = send_weights([r.address for r in rxs], token, 3, state, timeout_s=30.0,
                            bucket_bytes=1 << 18)
        got = [r.result(30.0) for r in rxs]
    finally:
        for r in rxs:
            r.close()
    exact = all(v == 3 and all(torch.equal(t[k], state[k].cpu()) for k in state)
                for v, t, _ in got)
    if not exact:
        raise AssertionError("a receiver's tensors differ from the sender's")
    return {"device": device, "bytes": sent["bytes"], "seconds": sent["seconds"]}


def run_part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = {"status": "ok", **fn()}
    except Skip as why:
        out = {"status": "skipped", "reason": str(why)}
    except Exception as err:  # noqa: BLE001 - reported in the file, never hidden
        out = {"status": "failed", "error": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_check.json"))
    a = ap.parse_args(argv)
    wanted = [p for p in a.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        print(f"unknown part(s) {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    res: dict[str, Any] = {"benchmark": "gpu_check", "commit": commit,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {}}
    with tempfile.TemporaryDirectory(prefix="rollart-gpu-check-") as tmp:
        fns = {"env": part_env, "fsdp": lambda: part_fsdp(Path(tmp)), "vllm": part_vllm,
               "sync": part_sync}
        for name in wanted:
            res["parts"][name] = run_part(name, fns[name])
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print("gpu_check: " + ", ".join(f"{k} {v['status']}" for k, v in res["parts"].items())
          + f" -> {a.out}")
    return 1 if any(v["status"] == "failed" for v in res["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
