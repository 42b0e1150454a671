"""`RunSpec`: what every stage and service of one run needs to know, parsed once.

The typed config and the run id travel together (pickled to Dask workers as they are, never
re-parsed from a dict); the store is opened from them where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.config import RunConfig, check_run_id
from rollart.storage.store import RunStore


@dataclass(frozen=True)
class RunSpec:
    cfg: RunConfig
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)  # a path in the store: never "../x" or "a/b"

    def store(self) -> RunStore:
        """The run's store as configured (endpoint, region, credentials, retry budget)."""
        return RunStore.from_config(self.cfg.storage, self.run_id)

    @property
    def model_path(self) -> str | None:
        """The local HF directory of the policy, or None for a config-built tiny model."""
        return self.cfg.model.path if self.cfg.model.source == "hf_dir" else None

    @property
    def max_context(self) -> int:
        """Longest conversation (tokens) an episode may build."""
        return self.cfg.model.tiny.max_position if self.cfg.model.source == "tiny" else 4096
