"""Where each iteration's metrics go besides `metrics.jsonl`: TensorBoard (`logging.tensorboard`),
the viewer verl and TRL users already open. Namespaced keys (`rollout/`, `train/`, ...) become
TensorBoard's tag groups; the x axis is the policy version (the iteration's step)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from rollart.config import RunConfig


class MetricSink(Protocol):
    def write(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars of every numeric, finite metric under `{dir}/{run_id}`."""

    def __init__(self, directory: str | Path, run_id: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(directory) / run_id
        self.writer = SummaryWriter(log_dir=str(self.path))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool) \
                    and math.isfinite(value) and key not in ("iteration", "version"):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_sinks(cfg: RunConfig, run_id: str) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(cfg.logging.tensorboard_dir, run_id))
    return sinks
