"""Policy loading: a tiny config-built Llama with a locally trained tokenizer, or a local HF dir.

Nothing here touches the network: HF directories load with `local_files_only=True`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rollart.config import ModelConfig, TinyModelConfig
from rollart.models.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny_llama_config(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,  # >= 32, checked by TinyModelConfig
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> LlamaForCausalLM:
    """Randomly initialised float32 Llama; the same seed gives the same weights."""
    config = tiny_llama_config(cfg, tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(torch.float32)


def load_policy(
    cfg: ModelConfig, corpus: Iterable[str] | None, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model, tokenizer). `corpus` is required for source "tiny" (tokenizer training)."""
    if cfg.source == "tiny":
        if corpus is None:
            raise ValueError("model.source 'tiny' needs a corpus to train its tokenizer on")
        tokenizer = build_tokenizer(corpus, cfg.tiny.vocab_size)
        model = build_tiny_model(cfg.tiny, tokenizer, seed)
        return model.to(DTYPES[cfg.dtype]), tokenizer
    path = Path(cfg.path or "")
    if not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[cfg.dtype], local_files_only=True
    )
    return own_weights(model), tokenizer


def own_weights(model: nn.Module) -> nn.Module:
    """Give every parameter memory of its own. `from_pretrained` leaves the weights in a
    private (copy-on-write) map of the safetensors file; the first in-place update (the
    optimizer's first step, an engine's weight sync) then copies the model page by page, each
    a fault plus a TLB flush on every core the process runs on. SmolLM2-135M's first AdamW
    step on a 2-core VM: 1.8 s on the map, 0.27 s on owned memory, which takes ~0.5 s more to
    load (benchmarks/owned_weights.py). Tied weights stay tied: the Parameter objects are
    kept, only their data is replaced."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def policy_skeleton(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of an `hf_dir` model with the model on the meta device: its
    architecture without weights or memory. A sharded trainer materialises only its shards of
    it and reads their weights from the directory (rollart/train/sharded_state.py
    `load_pretrained`), so no rank ever holds the whole model."""
    path = Path(cfg.path or "")
    if cfg.source != "hf_dir" or not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    return model, tokenizer


def save_hf_dir(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Write model (safetensors) + tokenizer so `load_policy(source="hf_dir")` can reload them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def param_count(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
