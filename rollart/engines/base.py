"""The inference-engine contract every backend (HF/torch, vLLM, ...) implements.

An engine lives on its worker for the whole run. It generates completions for token-level
requests (the caller owns tokenization and the chat format), returns per-token behaviour
log-probs, and stamps every completion with the weight version that produced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor

from rollart.types import Completion, GenerationRequest


@runtime_checkable
class InferenceEngine(Protocol):
    weight_version: int

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One completion per request, in request order."""
        ...

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor]) -> None:
        """Load new policy weights; completions generated afterwards carry `version`."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Stop (or never start) the given requests."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory between rollout phases, where the backend can."""
        ...

    def wake(self) -> None:
        """Undo `sleep`."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters: tokens generated, generate seconds, requests served, ..."""
        ...


def engine_stats(counters: Mapping[str, float], weight_version: int) -> dict[str, float]:
    """An engine's `stats()`: its counters plus tokens/s and the served weight version."""
    s = dict(counters)
    s["tokens_per_s"] = s["tokens_generated"] / s["generate_s"] if s["generate_s"] else 0.0
    s["weight_version"] = float(weight_version)
    return s
