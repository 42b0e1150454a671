"""Long-lived services held on their hardware-class workers for the whole run (Dask actors).

`EngineService` wraps an InferenceEngine on an engine-class worker; `TrainerService` wraps the
Trainer on the trainer-class worker. Both load the run's tokenizer from the store (built once by
the prepare stage) and build the same architecture; the engine then receives the trainer's
weights as version 0, so the two start bit-identical. Models never travel as task arguments.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from typing import Any

import torch

from rollart.config import RunConfig, config_from_dict
from rollart.engines.hf import HFEngine
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model, load_policy
from rollart.models.tokenizer import build_tokenizer
from rollart.storage.store import RunStore
from rollart.train.trainer import Trainer
from rollart.types import Completion, GenerationRequest, Trajectory

TOKENIZER_DIR = "tokenizer"


def worker_identity() -> dict[str, Any]:
    """Name and resources of the Dask worker running the caller (empty outside a worker)."""
    try:
        from distributed import get_worker

        w = get_worker()
        return {"worker": w.name, "address": w.address, "resources": dict(w.state.total_resources)}
    except (ImportError, ValueError):
        return {"worker": None, "address": None, "resources": {}}


def prepare_tokenizer(cfg: RunConfig, store: RunStore) -> int:
    """Build the run's tokenizer from the tasks' texts (env code: runs on an env-class worker)
    and save it to the store. HF-dir models bring their own tokenizer. Returns vocab size."""
    if cfg.model.source == "hf_dir":
        return -1
    if store.exists(f"{TOKENIZER_DIR}/tokenizer.json"):
        return len(load_run_tokenizer(store.root, store.run_id))
    corpus: list[str] = []
    for task in cfg.tasks:
        env = make_env(task)
        corpus.extend(env.corpus_texts(episodes=20, seed=cfg.seed))
        env.close()
    tok = build_tokenizer(corpus, cfg.model.tiny.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        store.put_dir(tmp, TOKENIZER_DIR)
    return len(tok)


@functools.lru_cache(maxsize=8)
def load_run_tokenizer(root: str, run_id: str):
    """Worker-level cache: a helper in an imported module survives across tasks on a worker."""
    from transformers import AutoTokenizer

    store = RunStore(root, run_id)
    local = store.get_dir(TOKENIZER_DIR, tempfile.mkdtemp(prefix="rollart-tok-"))
    return AutoTokenizer.from_pretrained(local, local_files_only=True)


@functools.lru_cache(maxsize=8)
def chat_format(root: str, run_id: str, model_path: str | None = None) -> ChatFormat:
    if model_path:
        from transformers import AutoTokenizer

        return ChatFormat(AutoTokenizer.from_pretrained(model_path, local_files_only=True))
    return ChatFormat(load_run_tokenizer(root, run_id))


def build_model(cfg: RunConfig, root: str, run_id: str):
    if cfg.model.source == "hf_dir":
        return load_policy(cfg.model, None, cfg.seed)
    tok = load_run_tokenizer(root, run_id)
    return build_tiny_model(cfg.model.tiny, tok, cfg.seed), tok


class EngineService:
    """Dask actor: one inference engine replica, alive for the run."""

    def __init__(self, cfg: dict[str, Any], root: str, run_id: str, replica: int = 0) -> None:
        self.cfg: RunConfig = config_from_dict(cfg)
        torch.set_num_threads(1)
        model, tok = build_model(self.cfg, root, run_id)
        self.engine = HFEngine(
            model, tok, seed=self.cfg.seed * 1000 + replica,
            max_batch_size=self.cfg.engine.max_batch_size, weight_version=-1,
        )
        self.replica = replica
        self.identity = worker_identity()
        self.sync_pauses: list[float] = []

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        # Thread settings are per OS thread under OpenMP, and actor methods run on their own
        # thread, so set them where the work happens.
        torch.set_num_threads(self.cfg.engine.threads)
        return self.engine.generate(requests)

    def update_weights(self, version: int, state: dict[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.update_weights(version, state)
        pause = time.perf_counter() - t0
        self.sync_pauses.append(pause)
        return {"version": float(version), "pause_s": pause}

    def weight_version(self) -> int:
        return self.engine.weight_version

    def fingerprint(self) -> float:
        return _fingerprint(self.engine.model)

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **self.identity, "replica": self.replica}

    def where(self) -> dict[str, Any]:
        return self.identity


class TrainerService:
    """Dask actor: model + optimizer (+ reference) on the trainer-class worker."""

    def __init__(self, cfg: dict[str, Any], root: str, run_id: str) -> None:
        self.cfg: RunConfig = config_from_dict(cfg)
        torch.set_num_threads(self.cfg.train.threads)
        torch.manual_seed(self.cfg.seed)
        model, tok = build_model(self.cfg, root, run_id)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.trainer = Trainer(model, self.cfg.algo, self.cfg.train,
                               temperature=self.cfg.engine.temperature, pad_id=int(pad))
        self.store = RunStore(root, run_id)
        self.identity = worker_identity()

    def update(self, trajs: list[Trajectory]) -> dict[str, Any]:
        torch.set_num_threads(self.cfg.train.threads)
        metrics = self.trainer.update(trajs)
        return {"metrics": metrics, "version": self.trainer.version, **self.identity}

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.trainer.version, self.trainer.export_weights()

    def save_checkpoint(self, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        files = self.trainer.checkpoint_files()
        meta = {**meta, "version": self.trainer.version, "config": self.cfg.model_dump(mode="json")}
        path = self.store.save_checkpoint(step, files, meta)
        removed = self.store.prune_checkpoints(self.cfg.storage.keep_last)
        return {"path": path, "bytes": sum(map(len, files.values())), "removed": removed,
                "save_s": time.perf_counter() - t0, **self.identity}

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        files, manifest = self.store.load_checkpoint(step)
        self.trainer.load_checkpoint_files(files)
        return {"step": step, "version": self.trainer.version,
                "meta": json.loads(json.dumps(manifest, default=str))}

    def fingerprint(self) -> float:
        return _fingerprint(self.trainer.model)

    def where(self) -> dict[str, Any]:
        return self.identity


def _fingerprint(model: torch.nn.Module) -> float:
    """Cheap parameter checksum (sum of |w| over every tensor), to see that weights changed."""
    with torch.no_grad():
        return float(sum(p.detach().abs().sum() for p in model.parameters()))


