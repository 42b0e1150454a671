"""Hardware-class catalog: the figures the router's cost model and the emulation work from.

A hardware class is what a Dask worker advertises as a resource (`H800=1`, `H20=1`, `CPU=8`) plus
the public numbers that decide which work suits it: dense bf16 peak FLOP/s (prefill is
compute-bound), memory bandwidth (decode reads every weight once per step, so it is
bandwidth-bound), memory, and a rough relative price. Config can override any class or add one
(`hardware:` in the run config); `DEFAULT_CATALOG` holds the defaults below.

Sources (dense figures; vendor sheets quote bf16 "with sparsity", which is twice these):
- H100 SXM5 / H800 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB. NVIDIA H100 Tensor Core
  GPU datasheet (1,979 TFLOP/s bf16 with sparsity). The H800 is the export variant of the H100
  SXM with the same compute and memory (its NVLink is cut to 400 GB/s), so the figures match.
- H20: 148 TFLOP/s bf16 dense, 4.0 TB/s HBM3, 96 GB. NVIDIA H20 product brief as reported
  publicly (e.g. SemiAnalysis, Nov 2023); also the figures RollArt (arXiv 2512.22560) assumes.
- H200 SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB. NVIDIA H200 datasheet.
- CPU: one AMD EPYC 9654 socket (AMD spec sheet: 96 cores, 2.4 GHz base, 12 channels DDR5-4800 =
  460.8 GB/s). FLOP/s is our arithmetic, not a vendor figure: 96 cores x 2.4 GHz x 32 fp32
  FLOP/cycle (two 256-bit FMA pipes) = 7.4 TFLOP/s. Memory assumes 12 x 64 GB DIMMs.
- relative_cost (per device-hour, H800 = 1): rough ratios of press-reported per-card prices
  (H100/H800 ~ $25-30k, H20 ~ $12-15k, H200 ~ $30-35k); used for reporting only, never for
  routing. Override them with your own prices.

See shared/REFERENCE.md ("Hardware figures for the cost model") for the same table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HardwareClass(BaseModel):
    """One hardware class. Units are the ones spec sheets use: TFLOP/s, GB/s, GB."""

    # allow_inf_nan=False: finite figures. use_attribute_docstrings: the docstring under each
    # field is its description (the docs' config reference is generated from them).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    name: str
    """Class name, e.g. H800 (also the Dask resource workers of the class carry)."""
    kind: Literal["gpu", "cpu"] = "gpu"
    """Device kind."""
    resource: str | None = None
    """Dask resource name; None: the class name."""
    peak_tflops: float = Field(gt=0.0)
    """Peak dense TFLOP/s, bf16 (fp32 for CPUs)."""
    mem_bw_gbs: float = Field(gt=0.0)
    """Memory bandwidth, GB/s."""
    memory_gb: float = Field(gt=0.0)
    """Device memory, GB."""
    relative_cost: float = Field(1.0, gt=0.0)
    """Cost per device-hour, H800 = 1."""

    @property
    def dask_resource(self) -> str:
        return self.resource or self.name

    @property
    def flops(self) -> float:
        """FLOP/s."""
        return self.peak_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        """Bytes/s."""
        return self.mem_bw_gbs * 1e9


DEFAULT_CATALOG: dict[str, HardwareClass] = {
    c.name: c
    for c in [
        HardwareClass(name="H800", peak_tflops=989, mem_bw_gbs=3350, memory_gb=80,
                      relative_cost=1.0),
        HardwareClass(name="H20", peak_tflops=148, mem_bw_gbs=4000, memory_gb=96,
                      relative_cost=0.45),
        HardwareClass(name="H100", peak_tflops=989, mem_bw_gbs=3350, memory_gb=80,
                      relative_cost=1.0),
        HardwareClass(name="H200", peak_tflops=989, mem_bw_gbs=4800, memory_gb=141,
                      relative_cost=1.2),
        HardwareClass(name="CPU", kind="cpu", peak_tflops=7.4, mem_bw_gbs=460.8, memory_gb=768,
                      relative_cost=0.1),
    ]
}


def default_catalog() -> dict[str, HardwareClass]:
    return dict(DEFAULT_CATALOG)


@dataclass(frozen=True)
class Slowdown:
    """Emulation factors (>= 1): how much slower than the host a class runs each phase."""

    prefill: float = 1.0
    decode: float = 1.0


def emulation_slowdowns(classes: Iterable[HardwareClass]) -> dict[str, Slowdown]:
    """Per-class slowdowns that make identical host replicas behave like `classes` relative to
    each other.

    Emulation can only slow a replica down, so the fastest class in each phase runs at host speed
    and the others are slowed by the ratio of the figure that bounds that phase:

        prefill(c) = max_k FLOP/s(k) / FLOP/s(c)        (prefill is compute-bound)
        decode(c)  = max_k bandwidth(k) / bandwidth(c)  (decode is bandwidth-bound)

    H800 + H20: H800 prefill 1, decode 4000/3350 = 1.19; H20 prefill 989/148 = 6.68, decode 1.
    """
    cs = list(classes)
    if not cs:
        return {}
    fmax = max(c.flops for c in cs)
    bmax = max(c.bandwidth for c in cs)
    return {c.name: Slowdown(prefill=fmax / c.flops, decode=bmax / c.bandwidth) for c in cs}


def host_matched_slowdowns(classes: Iterable[HardwareClass], flops_per_token: float,
                           bytes_per_token: float, host_prefill_s: float, host_decode_s: float,
                           dilation: float = 1.0) -> dict[str, Slowdown]:
    """Per-class slowdowns that make the host play each class *as a scaled copy of the GPU*,
    not as a scaled copy of the host.

    `emulation_slowdowns` keeps the host's own prefill:decode cost ratio, and a CPU decodes
    cheaply relative to prefill (per token, ~1:3 here vs ~1:37 on an H800 at decode batch 8), so
    decode-heavy work would look prefill-bound. Here each phase's emulated per-token time is the
    class's cost-model time times one common scale s:

        prefill(c) = s * flops_per_token / FLOP/s(c) / host_prefill_s
        decode(c)  = s * bytes_per_token / bandwidth(c) / host_decode_s

    host_prefill_s / host_decode_s: measured host seconds per prefill token and per decode token
    (at the same decode batch as bytes_per_token assumes). s is chosen so that the smallest
    factor over both phases and all classes equals `dilation` (>= 1), since emulation can only
    slow down."""
    cs = list(classes)
    raw = {c.name: (flops_per_token / c.flops / host_prefill_s,
                    bytes_per_token / c.bandwidth / host_decode_s) for c in cs}
    if not raw:
        return {}
    s = max(dilation, 1.0) / min(min(p, d) for p, d in raw.values())
    return {n: Slowdown(prefill=p * s, decode=d * s) for n, (p, d) in raw.items()}


def emulated_class(real: HardwareClass, flops_per_token: float, bytes_per_token: float,
                   host_prefill_s: float, host_decode_s: float,
                   slowdown: Slowdown) -> HardwareClass:
    """The class as an emulated host replica realises it, in the cost model's units: effective
    FLOP/s and bytes/s = per-token work / (measured host time per token x slowdown). A router
    built on these classes estimates emulated seconds."""
    return real.model_copy(update={
        "name": f"{real.name}-emu",
        "peak_tflops": flops_per_token / (host_prefill_s * slowdown.prefill) / 1e12,
        "mem_bw_gbs": bytes_per_token / (host_decode_s * slowdown.decode) / 1e9,
    })
