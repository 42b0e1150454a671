"""Policy models, tokenizer and chat format."""

from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model, load_policy, param_count, save_hf_dir
from rollart.models.tokenizer import build_tokenizer

__all__ = [
    "ChatFormat",
    "build_tiny_model",
    "build_tokenizer",
    "load_policy",
    "param_count",
    "save_hf_dir",
]
