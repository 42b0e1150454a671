"""Model-based reward: a small sequence classifier loaded inside the function.

The model comes from a local HF directory (`model_dir` in the event, else the environment
variable ROLLART_REWARD_MODEL_DIR), or, with neither, is a tiny Llama-style classifier built from
config with a seeded init (no download, nothing on disk: useful for tests and smoke runs).

Models are cached at module level, keyed by source: a warm Lambda worker (or a local client)
loads once and every later invocation reuses the model; `cold_start` in the result says which
kind of call it was. torch/transformers are imported on first use, so workers serving other
rewards never pay for them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from rollart.rewards.events import response_of

ENV_DIR = "ROLLART_REWARD_MODEL_DIR"
MAX_TOKENS = 512
_CACHE: dict[str, tuple[Any, Any]] = {}  # source -> (model, tokenizer or None)
_LOCK = threading.Lock()  # one load per source even when a thread pool calls the handler


def tiny_classifier(seed: int = 0) -> Any:
    """A 2-layer Llama classifier over bytes (vocab 259 = 3 specials + 256 bytes), num_labels 1."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(cfg)
    return model.eval()


def _load(source: str) -> tuple[Any, Any]:
    if source.startswith("builtin:"):
        return tiny_classifier(int(source.split(":", 1)[1])), None
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    has_tok = any(os.path.exists(os.path.join(source, f))
                  for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"))
    return model, (AutoTokenizer.from_pretrained(source) if has_tok else None)


def get_model(source: str) -> tuple[Any, Any, bool, float]:
    """(model, tokenizer, cold_start, load_s) from the module-level cache."""
    with _LOCK:
        if source in _CACHE:
            return (*_CACHE[source], False, 0.0)
        t0 = time.perf_counter()
        _CACHE[source] = _load(source)
        return (*_CACHE[source], True, time.perf_counter() - t0)


def byte_ids(text: str) -> list[int]:
    return [1] + [b + 3 for b in text.encode("utf-8")][: MAX_TOKENS - 1]


def reward_model(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """event: {"text" | "response" | "final_response": str, "prompt": str = "",
    "model_dir": str (optional), "seed": int = 0 (built-in model), "label": int = -1}

    reward = sigmoid(logit) for a single-logit model, else softmax probability of `label`.
    """
    import torch

    path = event.get("model_dir") or os.environ.get(ENV_DIR)
    source = os.path.realpath(path) if path else f"builtin:{int(event.get('seed', 0))}"
    model, tok, cold, load_s = get_model(source)
    text = str(event.get("prompt", "")) + str(event.get("text", response_of(event)))
    if tok is not None:
        ids = tok(text, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")["input_ids"]
    else:
        ids = torch.tensor([byte_ids(text)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    if logits.numel() == 1:
        score = torch.sigmoid(logits[0])
    else:
        score = torch.softmax(logits, -1)[int(event.get("label", -1))]
    return {"reward": float(score), "logit": float(logits.reshape(-1)[-1]),
            "cold_start": float(cold), "load_s": load_s}
