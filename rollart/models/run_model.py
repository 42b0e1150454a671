"""The run's policy as every worker rebuilds it: tokenizer (trained once, kept in the store),
chat format and model. Caches live in this imported module, so they persist per worker process
(a cache in a `@task` body would not: Prefect pickles task functions by value). Torch and
the model code load with the functions that need them: the flow process imports this module
without either.
"""

from __future__ import annotations

import tempfile
import threading
from typing import TYPE_CHECKING, Any

from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.run import RunSpec
from rollart.storage.store import RunStore

if TYPE_CHECKING:
    import torch

TOKENIZER_DIR = "tokenizer"

_cache: dict[tuple[str, ...], Any] = {}
_cache_lock = threading.Lock()


def _cached(key: tuple[str, ...], make: Any) -> Any:
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    value = make()
    with _cache_lock:
        return _cache.setdefault(key, value)


def prepare_tokenizer(run: RunSpec, store: RunStore) -> int:
    """Build the run's tokenizer from the tasks' texts (env code: runs on an env-class worker)
    and save it to the store. HF-dir models bring their own tokenizer. Returns vocab size."""
    cfg = run.cfg
    if cfg.model.source == "hf_dir":
        return -1
    if store.exists(f"{TOKENIZER_DIR}/tokenizer.json"):
        return len(load_run_tokenizer(store))
    corpus: list[str] = []
    for task in cfg.tasks:
        env = make_env(task)
        corpus.extend(env.corpus_texts(episodes=20, seed=cfg.seed))
        env.close()
    from rollart.models.tokenizer import build_tokenizer

    tok = build_tokenizer(corpus, cfg.model.tiny.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        store.put_dir(tmp, TOKENIZER_DIR)
    return len(tok)


def load_run_tokenizer(store: RunStore) -> Any:
    """The tokenizer `prepare_tokenizer` saved for this run (loaded once per process)."""

    def load() -> Any:
        from transformers import AutoTokenizer

        local = store.get_dir(TOKENIZER_DIR, tempfile.mkdtemp(prefix="rollart-tok-"))
        return AutoTokenizer.from_pretrained(local, local_files_only=True)

    return _cached(("tokenizer", store.url), load)


def chat_format(run: RunSpec) -> ChatFormat:
    """The run's chat format (from the HF directory's tokenizer or the run's own)."""
    path = run.model_path

    def make() -> ChatFormat:
        if path:
            from transformers import AutoTokenizer

            return ChatFormat(AutoTokenizer.from_pretrained(path, local_files_only=True))
        return ChatFormat(load_run_tokenizer(run.store()))

    # keyed without opening the store: a cache hit costs nothing
    return _cached(("chat", path or f"{run.cfg.storage.root}/{run.run_id}"), make)


def build_model(run: RunSpec, skeleton: bool = False) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer): the same architecture and initial weights on every worker.
    `skeleton` (an `hf_dir` model for a sharded trainer): the model on the meta device, its
    weights left to be read shard by shard."""
    from rollart.models.policy import build_tiny_model, load_policy, policy_skeleton

    cfg = run.cfg
    if cfg.model.source == "hf_dir":
        if skeleton:
            return policy_skeleton(cfg.model)
        return load_policy(cfg.model, None, cfg.seed)
    tok = load_run_tokenizer(run.store())
    return build_tiny_model(cfg.model.tiny, tok, cfg.seed), tok


def param_checksum(model: torch.nn.Module) -> float:
    """Cheap parameter checksum (sum of |w| over every tensor), to see that weights changed."""
    import torch

    with torch.no_grad():
        return float(sum(p.detach().abs().sum() for p in model.parameters()))
