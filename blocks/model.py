"""`ModelSource` block: which policy a run starts from."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field


class ModelSource(Block):
    """The initial policy: a tiny model built from config, or a local Hugging Face directory."""

    _block_type_name: ClassVar[str] = "rollart model source"
    _block_type_slug: ClassVar[str] = "rollart-model-source"
    _description: ClassVar[str] = "Initial policy of a rollart run (tiny config-built or HF dir)."

    source: str = Field("tiny", description="tiny | hf_dir (see configs/default.yaml)")
    path: str | None = Field(None, description="Model directory when source is hf_dir")
    dtype: str = Field("float32", description="float32 | bfloat16")
    tiny: dict[str, Any] | None = Field(None, description="model.tiny overrides (tiny only)")

    def config_overrides(self) -> list[str]:
        out = [f"model.source={json.dumps(self.source)}", f"model.path={json.dumps(self.path)}",
               f"model.dtype={json.dumps(self.dtype)}"]
        for k, v in (self.tiny or {}).items():
            out.append(f"model.tiny.{k}={json.dumps(v)}")
        return out

    def environment(self) -> dict[str, str]:
        return {}
