"""HFEngine emulated hardware: each forward pass is followed by (factor - 1) x its own time."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import time

import pytest
import torch
from torch import nn

from rollart.config import TinyModelConfig
from rollart.engines import HFEngine
from rollart.models import build_tiny_model, build_tokenizer
from rollart.routing import Slowdown
from rollart.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)
STEP_S = 0.02  # every forward pass of the wrapped model takes at least this long


class SlowForward(nn.Module):
    """A tiny Llama whose forward takes a known time, so the emulated time is predictable."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kw):
        time.sleep(STEP_S)
        return self.inner(**kw)


@pytest.fixture(scope="module")
def parts():
    tok = build_tokenizer(["one two three four five six seven eight nine ten"] * 8, 200)
    return SlowForward(build_tiny_model(TinyModelConfig(), tok, 0)), tok


def run(parts, emulate, new_tokens=5):
    model, tok = parts
    engine = HFEngine(model, tok, eos_token_ids=[], emulate=emulate)  # no eos: exact lengths
    req = GenerationRequest("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=new_tokens))
    t0 = time.perf_counter()
    (c,) = engine.generate([req])
    assert len(c.token_ids) == new_tokens  # 1 prefill pass + 4 decode passes
    return time.perf_counter() - t0, engine.stats()


def test_slowdown_factors_scale_prefill_and_decode_time(parts):
    base, s0 = run(parts, None)
    assert s0["emulated_prefill_s"] == s0["emulated_decode_s"] == 0.0
    # prefill x4: one pass of >= 20 ms gets >= 60 ms more; decode untouched
    t_p, s_p = run(parts, Slowdown(prefill=4.0, decode=1.0))
    # (upper bounds are loose: a loaded host stretches the measured pass, and the sleep with it)
    assert 3 * STEP_S <= s_p["emulated_prefill_s"] < 3 * 6 * STEP_S
    assert s_p["emulated_decode_s"] == 0.0
    assert t_p >= 5 * STEP_S + s_p["emulated_prefill_s"]  # 5 passes plus the sleep
    # decode x3: four passes of >= 20 ms get >= 2 x 20 ms each
    t_d, s_d = run(parts, Slowdown(prefill=1.0, decode=3.0))
    assert 8 * STEP_S <= s_d["emulated_decode_s"] < 8 * 6 * STEP_S
    # the wall time holds the passes and the sleep (only lower bounds: load can only add)
    assert t_d >= 5 * STEP_S + s_d["emulated_decode_s"]
    assert base >= 5 * STEP_S


def test_factor_one_is_a_no_op(parts):
    _, s = run(parts, Slowdown(1.0, 1.0))
    assert s["emulated_prefill_s"] == s["emulated_decode_s"] == 0.0
