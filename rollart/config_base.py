"""The base of every config model, and the one error type config problems raise."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
