"""The inference-engine contract every backend (HF/torch, vLLM, ...) implements.

An engine lives on its worker for the whole run. It generates completions for token-level
requests (the caller owns tokenization and the chat format), returns per-token behaviour
log-probs, and stamps every completion with the weight version that produced it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
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


class AbortSet:
    """Request ids marked for abort, shared between `abort` (any thread) and the generate loop.

    `take` consumes a mark, so an id re-issued later under the same name is not aborted again.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._ids.update(request_ids)

    def take(self, request_id: str) -> bool:
        """True (and forget the mark) if `request_id` was marked for abort."""
        with self._lock:
            if request_id in self._ids:
                self._ids.discard(request_id)
                return True
            return False

    def __bool__(self) -> bool:
        return bool(self._ids)
