"""Long-lived services held on their hardware-class workers for the whole run (Dask actors).

`EngineService` wraps an InferenceEngine on an engine-class worker; `TrainerService` wraps the
Trainer on the trainer-class worker. Both load the run's tokenizer from the store (built once by
the prepare stage) and build the same architecture; the engine then receives the trainer's
weights as version 0, so the two start bit-identical. Models never travel as task arguments.
"""

from __future__ import annotations

import functools
import io
import logging
import tempfile
import time
from typing import Any

import safetensors.torch
import torch

from rollart.config import RunConfig, config_from_dict
from rollart.engines import make_engine
from rollart.envs import make_env
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model, load_policy, param_count
from rollart.models.tokenizer import build_tokenizer
from rollart.routing.setup import emulation_factors
from rollart.storage.checkpointing import Checkpointer
from rollart.storage.store import RunStore
from rollart.storage.weights import load_weights_bytes, retie
from rollart.train.trainer import Trainer
from rollart.types import Completion, GenerationRequest, Trajectory

log = logging.getLogger("rollart")

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
        self.store = RunStore.from_config(self.cfg.storage, run_id)
        model, tok = build_model(self.cfg, root, run_id)
        self.params = float(param_count(model))
        # Hardware class of this replica (cluster.engine_pools); emulated slowdowns only when
        # routing.emulation.enabled (benchmarks: every pool is the same CPU here; HF engine).
        self.hw_class = self.cfg.cluster.engine_classes(self.cfg.engine.replicas)[replica]
        slow = emulation_factors(self.cfg).get(self.hw_class)
        self.engine = make_engine(self.cfg, model, tok, seed=self.cfg.seed * 1000 + replica,
                                  weight_version=-1,  # engine.backend: hf or vllm
                                  **({"emulate": slow} if slow is not None else {}))
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

    def pull_weights(self, version: int) -> dict[str, float]:
        """Load a published weight version from the store (`weights/v{version}/`)."""
        t0 = time.perf_counter()
        data, _ = load_weights_bytes(self.store, version)
        pull_s = time.perf_counter() - t0
        state = retie(safetensors.torch.load(data), self.engine.model)
        out = self.update_weights(version, state)
        return {**out, "pull_s": pull_s, "bytes": float(len(data))}

    def rng_state(self) -> bytes:
        """The sampling generator's state (saved in checkpoints for exact resume)."""
        return self.engine.generator.get_state().numpy().tobytes()

    def restore_rng(self, step: int) -> bool:
        """Restore this replica's sampling generator from checkpoint `step` (if recorded)."""
        files, _ = self.store.load_checkpoint(step, only=["engine_rng.pt"])
        if "engine_rng.pt" not in files:
            return False
        states = torch.load(io.BytesIO(files["engine_rng.pt"]))
        if self.replica >= len(states):
            log.warning("checkpoint %d has no RNG state for engine replica %d", step, self.replica)
            return False
        self.engine.generator.set_state(torch.frombuffer(bytearray(states[self.replica]),
                                                         dtype=torch.uint8))
        return True

    def weight_version(self) -> int:
        return self.engine.weight_version

    def param_count(self) -> float:
        return self.params

    def fingerprint(self) -> float:
        return param_checksum(self.engine.model)

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **self.identity, "replica": self.replica}

    def where(self) -> dict[str, Any]:
        return self.identity

    def close(self) -> None:
        """Shut the engine down (vLLM frees its engine core; HF has nothing to free)."""
        getattr(self.engine, "close", lambda: None)()


class TrainerService:
    """Dask actor: model + optimizer (+ reference) on the trainer-class worker."""

    def __init__(self, cfg: dict[str, Any], root: str, run_id: str) -> None:
        self.cfg: RunConfig = config_from_dict(cfg)
        torch.set_num_threads(self.cfg.train.threads)
        torch.manual_seed(self.cfg.seed)
        self.store = RunStore.from_config(self.cfg.storage, run_id)
        model, tok = build_model(self.cfg, root, run_id)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.trainer = Trainer(model, self.cfg.algo, self.cfg.train,
                               temperature=self.cfg.engine.temperature, pad_id=int(pad))
        # Ledger, checkpoint snapshots and background uploads (rollart/storage/checkpointing.py)
        self.ckpt = Checkpointer(self.cfg, self.store)
        self.identity = worker_identity()

    def update(self, trajs: list[Trajectory],
               dropped: list[tuple[str, int, str]] | None = None) -> dict[str, Any]:
        """One policy update; then every sample's fate goes into the ledger (consumed by this
        step, or dropped with a reason, incl. `dropped` from earlier stages)."""
        torch.set_num_threads(self.cfg.train.threads)
        metrics = self.trainer.update(trajs)
        metrics["train/samples_consumed"] = float(self.ckpt.record_update(
            trajs, dropped, self.trainer.step, skipped="train/skipped" in metrics))
        every = self.cfg.storage.weights_every
        if every and not self.cfg.storage.sync_via_store and self.trainer.version % every == 0:
            metrics["perf/weights_publish_wait_s"] = self.ckpt.publish_async(self.trainer)
        return {"metrics": metrics, "version": self.trainer.version, **self.identity}

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.trainer.version, self.trainer.export_weights()

    def sync_via_store(self) -> bool:
        return self.cfg.storage.sync_via_store

    def publish_weights(self) -> dict[str, Any]:
        """Publish the current version to `weights/v{n}/` now (store-mediated sync)."""
        return self.ckpt.publish_now(self.trainer)

    def save_checkpoint(self, step: int, meta: dict[str, Any],
                        engine_rng: list[bytes] | None = None,
                        pending: list[Trajectory] | None = None) -> dict[str, Any]:
        """Snapshot now, upload in the background (`storage.background_upload`)."""
        return {**self.ckpt.save(self.trainer, step, meta, engine_rng, pending), **self.identity}

    def flush_checkpoints(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for background uploads (checkpoints, weight versions); raises a failure."""
        return self.ckpt.flush(timeout)

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        """Restore model, optimizer, RNG, step/version, sample ledger and pending samples."""
        return self.ckpt.restore(self.trainer, step)

    def take_pending(self) -> list[Trajectory]:
        """Complete-but-unconsumed samples restored from the checkpoint (handed out once)."""
        out, self.ckpt.pending = self.ckpt.pending, []
        return out

    def ledger_records(self) -> list[list[Any]]:
        return [list(r) for r in self.ckpt.ledger.records]

    def fingerprint(self) -> float:
        return param_checksum(self.trainer.model)

    def where(self) -> dict[str, Any]:
        return self.identity


def param_checksum(model: torch.nn.Module) -> float:
    """Cheap parameter checksum (sum of |w| over every tensor), to see that weights changed."""
    with torch.no_grad():
        return float(sum(p.detach().abs().sum() for p in model.parameters()))




class RolloutServiceActor:
    """Dask actor: the run's RolloutService on an env-class worker. Its threads call the engine
    and env-host actors; `take_batch` is a coroutine (it polls on the worker's event loop), so
    waiting for a batch never holds the worker's single actor thread."""

    def __init__(self, cfg: dict[str, Any], root: str, run_id: str, engines: list[Any],
                 host_refs: list[tuple[str, str]], version: int = 0) -> None:
        from distributed.actor import Actor

        from rollart.rollout.env_host import EnvHostService
        from rollart.stages import rollout_service

        # Env hosts by (actor key, worker address): handles, not graph dependencies.
        hosts = [Actor(EnvHostService, address, key) for key, address in host_refs]
        self.service = rollout_service(config_from_dict(cfg), root, run_id, engines, hosts,
                                       version)

    def start(self) -> dict[str, Any]:
        self.service.start()
        return worker_identity()

    async def take_batch(self, update: int) -> tuple[list[Trajectory], dict[str, Any]]:
        import asyncio

        t0 = time.perf_counter()
        while (out := self.service.try_take(update)) is None:
            await asyncio.sleep(0.02)
        out[1]["metrics"]["rollout/wait_s"] = time.perf_counter() - t0
        return out

    def set_version(self, version: int) -> None:
        self.service.set_version(version)

    def stats(self) -> dict[str, Any]:
        return self.service.stats()

    def stop(self) -> dict[str, Any]:
        return self.service.stop()
