"""The GPU check script's machinery on a machine without CUDA: the parts it cannot run are
reported skipped with the reason, the weight stream part runs from CPU tensors, and the file
says which is which (`benchmarks/gpu_check.py` on a GPU machine runs every part)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the CPU-only path")
def test_without_gpus_parts_are_skipped_with_reasons_and_sync_runs(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert parts["env"]["status"] == "ok" and parts["env"]["gpus"] == 0
    for name in ("fsdp", "vllm"):
        assert parts[name]["status"] == "skipped" and parts[name]["reason"]
    assert parts["sync"]["status"] == "ok" and parts["sync"]["device"] == "cpu"


def test_unknown_part_is_refused(tmp_path):
    assert gpu_check.main(["--parts", "env,warp", "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
