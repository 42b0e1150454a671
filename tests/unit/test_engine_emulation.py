"""HFEngine emulated hardware: each forward pass is followed by (factor - 1) x its own time."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import math
import time

import pytest
import torch
from torch import nn

from rollart.config import TinyModelConfig
from rollart.engines import HFEngine
from rollart.models import build_tiny_model, build_tokenizer
from rollart.routing import DEFAULT_CATALOG, ServiceModel, Slowdown
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
    # Upper bounds relative to the measured passes (forward_s: all 5), since a loaded host
    # stretches the pass and the sleep with it (issue 21): the sleep is (factor - 1) x the pass.
    assert 3 * STEP_S <= s_p["emulated_prefill_s"] <= 3 * s_p["forward_s"] * (1 + 1e-9)
    assert s_p["emulated_decode_s"] == 0.0
    assert t_p >= 5 * STEP_S + s_p["emulated_prefill_s"]  # 5 passes plus the sleep
    # decode x3: four passes of >= 20 ms get >= 2 x 20 ms each
    t_d, s_d = run(parts, Slowdown(prefill=1.0, decode=3.0))
    assert 8 * STEP_S <= s_d["emulated_decode_s"] <= 2 * s_d["forward_s"] * (1 + 1e-9)
    # the wall time holds the passes and the sleep (only lower bounds: load can only add)
    assert t_d >= 5 * STEP_S + s_d["emulated_decode_s"]
    assert base >= 5 * STEP_S


def test_factor_one_is_a_no_op(parts):
    _, s = run(parts, Slowdown(1.0, 1.0))
    assert s["emulated_prefill_s"] == s["emulated_decode_s"] == 0.0


# ---------------------------------------------------------------- modelled service time

H800, H20 = DEFAULT_CATALOG["H800"], DEFAULT_CATALOG["H20"]


def test_service_model_roofline_hand_computed():
    m = ServiceModel(H20, params=1e9, bytes_per_param=2.0)
    # decode step: weights 2e9 B / 4e12 B/s = 0.5 ms whatever the rows (8 x 2e9 / 148e12 = 0.11)
    assert m.decode_step_s(1) == m.decode_step_s(8) == pytest.approx(0.5e-3)
    # compute-bound above 148e12 / 4e12 = 37 rows: 40 x 2e9 / 148e12 = 0.5405 ms > 0.5 ms
    assert m.decode_step_s(40) == pytest.approx(40 * 2e9 / 148e12)
    # prefill of 1000 tokens: 1000 x 2e9 / 148e12 = 13.514 ms on H20, 2.0222 ms on H800
    assert m.prefill_s(1000) == pytest.approx(13.514e-3, rel=1e-4)
    assert ServiceModel(H800, 1e9).prefill_s(1000) == pytest.approx(2.0222e-3, rel=1e-4)
    # a batch: prompts of 4 and 6 tokens -> one prefill pass over 10 tokens (0.5 ms floor), then
    # 4 decode steps (rows needing > 1, > 2, > 3, > 4 tokens: 2, 1, 1, 1 rows) of 0.5 ms each
    assert m.batch_s([4, 6], [5, 2]) == pytest.approx(5 * 0.5e-3)
    assert ServiceModel(H20, 1e9, time_scale=10).batch_s([4, 6], [5, 2]) == pytest.approx(25e-3)
    with pytest.raises(ValueError):
        ServiceModel(H20).prefill_s(1)  # params unset and not filled in by an engine


def run_modelled(parts, model_kw, new_tokens=5):
    model, tok = parts
    sm = ServiceModel(H800, params=1e9, **model_kw)
    engine = HFEngine(model, tok, eos_token_ids=[], emulate=sm)
    req = GenerationRequest("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=new_tokens))
    t0 = time.perf_counter()
    (c,) = engine.generate([req])
    return time.perf_counter() - t0, engine.stats(), c


def test_modelled_time_subtracts_the_real_pass(parts):
    # H800, 1e9 params bf16, time scale 50: every pass (4-token prefill or 1-row decode step) is
    # weight-bound: 50 x 2e9 / 3.35e12 = 29.85 ms; 5 tokens = 1 prefill + 4 decode passes.
    modelled = 5 * 50 * 2e9 / 3.35e12
    wall, s, c = run_modelled(parts, {"time_scale": 50})
    assert len(c.token_ids) == 5
    assert s["emulated_modelled_s"] == pytest.approx(modelled)
    assert s["forward_s"] >= 5 * STEP_S  # the real passes ran (each sleeps 20 ms)...
    assert wall >= modelled  # ... under the modelled time: sleep until the deadline
    assert s["emulated_prefill_s"] == s["emulated_decode_s"] == 0.0  # Slowdown's counters
    assert s["emulated_sleep_s"] <= modelled - 5 * STEP_S  # the passes' own time was subtracted
    assert s["emulated_sleep_s"] + s["forward_s"] <= wall
    assert s["emulated_overrun_s"] <= wall - modelled


def test_overrun_is_counted_when_the_real_pass_is_slower(parts):
    # time scale 10: 5.97 ms per pass < the 20 ms pass, so the batch overruns by >= 100 - 29.85 ms
    modelled = 5 * 10 * 2e9 / 3.35e12
    wall, s, _ = run_modelled(parts, {"time_scale": 10})
    assert s["emulated_overrun_s"] >= 5 * STEP_S - modelled
    assert wall >= 5 * STEP_S


def test_modelled_time_without_the_forward_pass(parts):
    modelled = 5 * 50 * 2e9 / 3.35e12
    wall, s, c = run_modelled(parts, {"time_scale": 50, "forward": False})
    assert s["forward_s"] == 0.0 and len(c.token_ids) == 5
    vocab = parts[0].config.vocab_size
    assert c.logprobs == pytest.approx([-math.log(vocab)] * 5)  # uniform logits
    assert wall >= modelled and s["emulated_modelled_s"] == pytest.approx(modelled)
