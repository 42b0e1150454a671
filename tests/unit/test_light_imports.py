"""The flow process imports what it submits (stage functions, service classes: Dask pickles
them by reference and hands actor classes back) without torch, transformers, safetensors or
vLLM: those cost seconds of one core at every `rollart train` before any worker starts, and
load in the workers that use them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "safetensors", "vllm")


def loaded_after(*modules: str) -> list[str]:
    """The heavy packages a fresh interpreter holds after importing `modules`."""
    code = (f"import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            f"print(json.dumps([p for p in {list(HEAVY)!r} if p in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_flow_and_the_classes_it_submits_import_without_torch() -> None:
    assert loaded_after("flows.train", "rollart.runner.stages", "rollart.services.engine",
                        "rollart.services.trainer", "rollart.rollout.env_host",
                        "rollart.services.rollout") == []


def test_the_lazy_model_names_resolve() -> None:
    import rollart.models as models

    assert models.ChatFormat.__module__ == "rollart.models.chat"
    assert callable(models.load_policy) and callable(models.build_tokenizer)
    try:
        models.nope  # noqa: B018
    except AttributeError as err:
        assert "nope" in str(err)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
