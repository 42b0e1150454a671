"""`EngineService`: one inference engine replica on an engine-class worker, alive for the run.

It loads the run's tokenizer from the store (built once by the prepare stage) and builds the
same architecture as the trainer; it then receives the trainer's weights as version 0, so the
two start bit-identical. Models never travel as task arguments.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import urlparse

from rollart.cpu_pinning import pin_to_class
from rollart.handles import set_call_timeout, worker_identity
from rollart.models.run_model import build_model, param_checksum
from rollart.routing.setup import emulation_factors
from rollart.run import RunSpec
from rollart.service_protocols import (
    SharedWeights,
    WeightsLoaded,
    WeightsPulled,
    WeightsStreamedIn,
)
from rollart.storage.store import checkpoint_rel
from rollart.types import Completion, GenerationRequest

if TYPE_CHECKING:  # torch and the engines load in the worker that builds one (__init__)
    import torch

    from rollart.engines.base import InferenceEngine
    from rollart.engines.weight_stream import WeightReceiver

    class ServedEngine(InferenceEngine, Protocol):
        """What this service uses of its engine beyond `InferenceEngine` (both backends have
        it): the served model (checkpoint checks, fingerprints) and the sampling generator
        (exact resume)."""

        model: torch.nn.Module
        generator: torch.Generator

log = logging.getLogger("rollart")


class EngineService:
    """One inference engine replica (`engine.backend`: hf or vllm)."""

    def __init__(self, run: RunSpec, replica: int = 0) -> None:
        import torch

        from rollart.engines import make_engine
        from rollart.models.policy import param_count

        self.run = run
        self.cfg = cfg = run.cfg
        set_call_timeout(cfg.cluster.call_timeout_s)  # calls made from this worker
        torch.set_num_threads(1)
        self.store = run.store()
        # vLLM reads an HF directory itself: this service needs only its architecture (the
        # parameter count), not a second copy of the weights to load, copy and free.
        skeleton = cfg.engine.backend == "vllm" and cfg.model.source == "hf_dir"
        model, tok = build_model(run, skeleton=skeleton)
        self.params = float(param_count(model))
        # Hardware class of this replica (cluster.engine_pools); emulated slowdowns only when
        # routing.emulation.enabled (benchmarks: every pool is the same CPU here; HF engine).
        self.hw_class = cfg.cluster.engine_classes(cfg.engine.replicas)[replica]
        pin_to_class(cfg.cluster.cpu_cores, self.hw_class)  # before vLLM binds its threads
        slow = emulation_factors(cfg).get(self.hw_class)
        self.engine = cast("ServedEngine", make_engine(
            cfg, model, tok, seed=cfg.seed * 1000 + replica, weight_version=-1,
            **({"emulate": slow} if slow is not None else {})))
        self.replica = replica
        self.identity = worker_identity()
        self.sync_pauses: list[float] = []
        self._rx: WeightReceiver | None = None  # the open weight stream, if any
        self._rx_buffers: dict[str, torch.Tensor] | None = None  # its staging, kept

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        # Thread settings are per OS thread under OpenMP, and actor methods run on their own
        # thread, so set them where the work happens.
        import torch

        torch.set_num_threads(self.cfg.engine.threads)
        return self.engine.generate(requests)

    def update_weights(self, version: int, state: dict[str, torch.Tensor]) -> WeightsLoaded:
        t0 = time.perf_counter()
        self.engine.update_weights(version, state)
        pause = time.perf_counter() - t0
        self.sync_pauses.append(pause)
        return {"version": float(version), "pause_s": pause}

    def load_shared_weights(self, desc: SharedWeights) -> WeightsLoaded | None:
        """Copy weights from the trainer's shared-memory file (same host); None when this
        process cannot map it, so the caller sends the tensors instead."""
        from rollart.engines.shared_weights import read_shared

        state = read_shared(dict(desc))
        if state is None:
            return None
        return self.update_weights(int(desc["version"]), state)

    def open_weight_stream(self, token: bytes, timeout_s: float) -> tuple[str, int]:
        """Listen for the trainer's next weights (rollart/engines/weight_stream.py) on this
        worker's own address; returns (host, port) for the trainer. `token` (random per sync,
        sent over the authenticated Dask connection) is what the upstream must prove."""
        from rollart.engines.weight_stream import WeightReceiver

        self.abort_weight_stream()
        host = urlparse(self.identity.get("address") or "").hostname or "127.0.0.1"
        self._rx = WeightReceiver(host, token, timeout_s, buffers=self._rx_buffers)
        return self._rx.address

    def finish_weight_stream(self, timeout_s: float) -> WeightsStreamedIn:
        """Wait for the stream opened last, then serve its weights (between two generate calls,
        as every sync). Its tensors are received into again at the next sync."""
        from rollart.storage.weights import retie

        rx, self._rx = self._rx, None
        if rx is None:
            raise RuntimeError("finish_weight_stream without open_weight_stream")
        try:
            version, state, stats = rx.result(timeout=timeout_s)
        finally:
            rx.close()
        self._rx_buffers = state
        out = self.update_weights(version, retie(state, self.engine.model))
        return {**out, "stream_s": float(stats.get("seconds", 0.0)),
                "bytes": float(stats.get("bytes", 0.0))}

    def abort_weight_stream(self) -> None:
        """Drop a stream that will not complete (the sync failed elsewhere)."""
        rx, self._rx = self._rx, None
        if rx is not None:
            rx.close()

    def pull_weights(self, version: int) -> WeightsPulled:
        """Load a published weight version from the store (`weights/v{version}/`)."""
        import safetensors.torch

        from rollart.storage.weights import load_weights_bytes, retie

        t0 = time.perf_counter()
        data, _ = load_weights_bytes(self.store, version)
        pull_s = time.perf_counter() - t0
        state = retie(safetensors.torch.load(data), self.engine.model)
        out = self.update_weights(version, state)
        return {**out, "pull_s": pull_s, "bytes": float(len(data))}

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        """Serve the weights of checkpoint `step` (evaluation of a finished run). Tied weights
        are stored once, so the state goes through a model of the run's architecture
        (strict=False restores the ties) before the engine's strict load; the served weights
        are then checked against it. The store authenticates the manifest and every file read
        (rollart/storage/integrity.py): a forged or altered checkpoint raises
        CheckpointRefused, one line naming the file, before any weight is loaded."""
        import safetensors.torch

        from rollart.train.sharded_state import (
            DCP_PREFIX,
            full_model_state,
            is_sharded_checkpoint,
        )

        names = list(self.store.read_manifest(step)["files"])
        model, _ = build_model(self.run)
        if is_sharded_checkpoint(names):  # a sharded trainer's: every rank's pieces, joined
            files, manifest = self.store.load_checkpoint(
                step, only=[n for n in names if n.startswith(DCP_PREFIX)])
            model.load_state_dict(full_model_state(model, files), strict=False)
        else:
            files, manifest = self.store.load_checkpoint(step, only=["model.safetensors"])
            model.load_state_dict(safetensors.torch.load(files["model.safetensors"]),
                                  strict=False)
        version = int(manifest.get("version", step))
        self.update_weights(version, model.state_dict())
        served, expected = self.fingerprint(), param_checksum(model)
        if abs(served - expected) > 1e-6 * max(1.0, abs(expected)):
            raise RuntimeError(f"engine weights differ from checkpoint {step} "
                               f"({checkpoint_rel(step)}) after loading")
        return {"step": step, "version": version, "fingerprint": served, **self.identity}

    def rng_state(self) -> bytes:
        """The sampling generator's state (saved in checkpoints for exact resume)."""
        return self.engine.generator.get_state().numpy().tobytes()

    def restore_rng(self, step: int) -> bool:
        """Restore this replica's sampling generator from checkpoint `step` (if recorded). The
        state is safetensors (no pickle is ever loaded); an older checkpoint's `engine_rng.pt`
        is not read: this replica then samples from a fresh seed (one warning line)."""
        import torch

        from rollart.train.state_io import (
            ENGINE_RNG,
            LEGACY_ENGINE_RNG,
            UnsafeCheckpointError,
            engine_rng_state,
        )

        files, _ = self.store.load_checkpoint(step, only=[ENGINE_RNG, LEGACY_ENGINE_RNG])
        if not files:
            return False
        try:
            state = engine_rng_state(files, self.replica)
        except UnsafeCheckpointError as err:
            log.warning("checkpoint %d: %s; engine replica %d samples from a fresh seed", step,
                        err, self.replica)
            return False
        if state is None:  # none recorded, or it was lost
            log.warning("checkpoint %d has no RNG state for engine replica %d", step, self.replica)
            return False
        self.engine.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
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
