"""Inference engines: the InferenceEngine protocol and backends."""

from rollart.engines.base import InferenceEngine
from rollart.engines.hf import HFEngine

__all__ = ["HFEngine", "InferenceEngine"]
