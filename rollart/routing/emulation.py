"""Modelled service time of an emulated engine replica: what the engine sleeps in emulation.

On one CPU host every engine pool is the same hardware, and two replicas that both compute on the
host's cores compete for them: an emulation that stretches the *measured* compute time (the older
`Slowdown` factors) amplifies that contention and the load of every other process, so CPU
contention, not the emulated hardware, decides which placement wins. Here the service time of
every forward pass is the cost model's time for the replica's hardware class, computed from token
counts alone, and the engine spends it as sleep (rollart.engines.hf, `emulate=ServiceModel`):

    prefill pass over T prompt tokens (all rows of the batch together, compute-bound):
        t = time_scale * max(T * flops_per_token / FLOP/s,  weight_bytes / bandwidth)
    decode step with A active rows (one token each; the weights are read once per step):
        t = time_scale * max(A * flops_per_token / FLOP/s,  weight_bytes / bandwidth)

with flops_per_token = 2 x params and weight_bytes = params x bytes_per_param: the roofline of a
GPU serving a batch. Decode is bandwidth-bound until A reaches FLOP/s / bandwidth x bytes_per_param
/ 2 rows (37 on an H20 and 295 on an H800 in bf16), so batching rows costs nothing per step, as on
a GPU. `params` is the model the emulation stands for (e.g. 7e9), not necessarily the model that
computes the tokens; None: the served model's own parameter count (the engine fills it in).

With `forward=True` the real forward pass still runs, so tokens and log-probs are real; at the end
of each batch the engine sleeps until the modelled end of all its passes, which subtracts their
CPU time as long as it is shorter than the modelled time, and counts any excess as overrun
(`emulated_overrun_s`). With `forward=False` the forward pass is skipped (uniform logits:
random tokens, log-prob = -log V): the service time is then exact up to the sleep's resolution.

The router's cost model (rollart.routing.router.CostModel) is the same arithmetic per request with
the decode weight read shared by `decode_batch` rows; the two agree when decode batches are full.
Pure: no clocks, no sleeping here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rollart.routing.catalog import HardwareClass


@dataclass(frozen=True)
class ServiceModel:
    hw: HardwareClass
    params: float | None = None  # the modelled model's parameters; None: the served model's
    bytes_per_param: float = 2.0  # bf16
    time_scale: float = 1.0  # wall seconds per modelled second (> 1 stretches every pass)
    forward: bool = True  # run the real forward pass (real tokens) under the modelled time

    def __post_init__(self) -> None:
        if self.params is not None and self.params <= 0:
            raise ValueError(f"params must be > 0, got {self.params}")
        if self.bytes_per_param <= 0 or self.time_scale <= 0:
            raise ValueError("bytes_per_param and time_scale must be > 0")

    def with_params(self, params: float) -> ServiceModel:
        """This model with `params` filled in where it was left to the served model."""
        return self if self.params is not None else replace(self, params=float(params))

    def _p(self) -> float:
        if self.params is None:
            raise ValueError("ServiceModel.params is unset: call with_params(served model's count)")
        return self.params

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self._p()

    @property
    def weight_bytes(self) -> float:
        return self._p() * self.bytes_per_param

    def _pass_s(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        return self.time_scale * max(tokens * self.flops_per_token / self.hw.flops,
                                     self.weight_bytes / self.hw.bandwidth)

    def prefill_s(self, prompt_tokens: float) -> float:
        """One batched prefill pass over `prompt_tokens` real (unpadded) tokens in all rows."""
        return self._pass_s(prompt_tokens)

    def decode_step_s(self, rows: int) -> float:
        """One decode step of `rows` active rows."""
        return self._pass_s(rows)

    def batch_s(self, prompt_tokens: Sequence[int], new_tokens: Sequence[int]) -> float:
        """One engine batch as the HF engine runs it: one prefill pass (it yields each row's first
        token), then decode steps while any row still needs tokens (finished rows drop out)."""
        if len(prompt_tokens) != len(new_tokens):
            raise ValueError("one prompt length per new-token count")
        rows = [n for n in new_tokens if n > 0]
        if not rows:
            return 0.0
        t = self.prefill_s(sum(p for p, n in zip(prompt_tokens, new_tokens, strict=True) if n > 0))
        for step in range(1, max(rows)):
            t += self.decode_step_s(sum(1 for n in rows if n > step))
        return t
