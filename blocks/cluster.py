"""`DaskCluster` block: where stages run (scheduler address and hardware-class map)."""

from __future__ import annotations

import json
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field

from rollart.config.hardware import default_stages, default_workers


class DaskCluster(Block):
    """A Dask cluster whose workers carry hardware-class resources. `scheduler_address` None
    means an embedded cluster started per run with `workers` per class."""

    _block_type_name: ClassVar[str] = "rollart dask cluster"
    _block_type_slug: ClassVar[str] = "rollart-dask-cluster"
    _description: ClassVar[str] = "Dask scheduler and hardware-class map for rollart stages."

    scheduler_address: str | None = Field(
        None, description="tls:// or tcp://host:8786; None: embedded")
    dashboard_url: str | None = Field(None, description="Dask dashboard, for people")
    workers: dict[str, int] = Field(
        default_factory=default_workers,
        description="Hardware class -> worker count (resource CLASS=1 on each)")
    stages: dict[str, str] = Field(
        default_factory=default_stages,
        description="Stage -> hardware class")

    def config_overrides(self) -> list[str]:
        return [f"cluster.address={json.dumps(self.scheduler_address)}",
                f"cluster.workers={json.dumps(self.workers)}",
                f"cluster.stages={json.dumps(self.stages)}"]

    def environment(self) -> dict[str, str]:
        return {}
