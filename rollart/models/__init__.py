"""Policy models, tokenizer and chat format.

The names load on first use (PEP 562): the flow process imports service classes that only
need the chat format, and importing torch and transformers there costs seconds of start-up
on one core while the workers wait for it (benchmarks/startup.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.models.chat import ChatFormat
    from rollart.models.policy import build_tiny_model, load_policy, param_count, save_hf_dir
    from rollart.models.tokenizer import build_tokenizer

_WHERE = {
    "ChatFormat": "rollart.models.chat",
    "build_tiny_model": "rollart.models.policy",
    "load_policy": "rollart.models.policy",
    "param_count": "rollart.models.policy",
    "save_hf_dir": "rollart.models.policy",
    "build_tokenizer": "rollart.models.tokenizer",
}

__all__ = [
    "ChatFormat",
    "build_tiny_model",
    "build_tokenizer",
    "load_policy",
    "param_count",
    "save_hf_dir",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rollart.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
