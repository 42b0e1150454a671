"""HFEngine: log-prob agreement with a full forward pass, padding invariance, finishing rules."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rollart.config import TinyModelConfig
from rollart.engines import HFEngine, InferenceEngine
from rollart.models import ChatFormat, build_tiny_model, build_tokenizer
from rollart.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)

CORPUS = [
    "You are playing FrozenLake. Reply with <answer>Left</answer>, Down, Right or Up.",
    "Turn 1:\nPFFF\nFHFH\nFFFH\nHFFG\n7 moves remaining.",
    "Turn 2:\nSFFF\nFHPH\nFFFH\nHFFG\n6 moves remaining.",
] * 4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, 320)


def sharp_model(tok, seed: int) -> nn.Module:
    """Tiny Llama with weights scaled up so greedy outputs vary token to token."""
    model = build_tiny_model(TinyModelConfig(), tok, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(10)
    return model.eval()


@pytest.fixture(scope="module")
def model(tok):
    return sharp_model(tok, 0)


def prompts(tok, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, len(tok), (n,), generator=g).tolist() for n in lengths]


def reqs(ps, **params):
    return [GenerationRequest(f"r{i}", p, SamplingParams(**params)) for i, p in enumerate(ps)]


def full_forward_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)  # [T, V]
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_full_forward(tok, model, temperature, top_p):
    engine = HFEngine(model, tok, seed=0, weight_version=5)
    assert isinstance(engine, InferenceEngine)
    ps = prompts(tok, [3, 29, 11, 50, 7])
    cs = engine.generate(reqs(ps, max_new_tokens=10, temperature=temperature, top_p=top_p))
    assert [c.request_id for c in cs] == [f"r{i}" for i in range(len(ps))]
    for p, c in zip(ps, cs, strict=True):
        assert len(c.token_ids) == len(c.logprobs) > 0
        ref = full_forward_logprobs(model, p, c.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
        assert c.weight_version == 5 and c.prompt_tokens == len(p) and c.generate_s > 0
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=False)


def test_greedy_padding_invariance_and_chunking(tok, model):
    ps = prompts(tok, [5, 40, 23, 61])
    alone = HFEngine(model, tok).generate(reqs(ps[:1], max_new_tokens=12, temperature=0))[0]
    assert len(set(alone.token_ids)) > 3  # a non-degenerate sequence
    batched = HFEngine(model, tok).generate(reqs(ps, max_new_tokens=12, temperature=0))
    chunked = HFEngine(model, tok, max_batch_size=2).generate(
        reqs(ps, max_new_tokens=12, temperature=0)
    )
    assert batched[0].token_ids == alone.token_ids == chunked[0].token_ids
    torch.testing.assert_close(batched[0].logprobs, alone.logprobs, atol=1e-4, rtol=0)
    assert [c.token_ids for c in batched] == [c.token_ids for c in chunked]
    # greedy log-probs are temperature-1 log-probs
    ref = full_forward_logprobs(model, ps[1], batched[1].token_ids)
    torch.testing.assert_close(torch.tensor(batched[1].logprobs), ref, atol=1e-4, rtol=0)


def test_tiny_top_p_is_greedy_and_seeded_sampling_reproducible(tok, model):
    ps = prompts(tok, [9, 30])
    greedy = HFEngine(model, tok).generate(reqs(ps, max_new_tokens=8, temperature=0))
    nucleus = HFEngine(model, tok, seed=3).generate(reqs(ps, max_new_tokens=8, top_p=1e-6))
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]
    a = HFEngine(model, tok, seed=7).generate(reqs(ps, max_new_tokens=8))
    b = HFEngine(model, tok, seed=7).generate(reqs(ps, max_new_tokens=8))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_update_weights_changes_output_and_version(tok, model):
    engine = HFEngine(sharp_model(tok, 0), tok)
    r = reqs(prompts(tok, [12, 20]), max_new_tokens=8, temperature=0)
    before = engine.generate(r)
    new = sharp_model(tok, 1).state_dict()
    engine.update_weights(3, new)
    after = engine.generate(r)
    assert engine.weight_version == 3 and all(c.weight_version == 3 for c in after)
    assert all(c.weight_version == 0 for c in before)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    with pytest.raises(RuntimeError):
        engine.update_weights(4, {k: v for k, v in new.items() if "layers.1" not in k})
    s = engine.stats()
    assert s["requests"] == 4 and s["tokens_generated"] == sum(len(c.token_ids) for c in after) * 2
    assert s["weight_version"] == 3 and s["tokens_per_s"] > 0


class ScriptedLM(nn.Module):
    """Fake causal LM: the k-th generated token of every row is script[k] (filler afterwards).

    All prompts must have length `prompt_len`; k is read off position_ids.
    """

    def __init__(self, script: list[int], vocab: int, prompt_len: int, filler: int):
        super().__init__()
        self.script, self.vocab, self.prompt_len, self.filler = script, vocab, prompt_len, filler

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, **_):
        k = position_ids[:, -1] - (self.prompt_len - 1)  # [A] index of the token to produce
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -20.0)
        for row, step in enumerate(k.tolist()):
            logits[row, 0, self.script[step] if step < len(self.script) else self.filler] = 20.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def scripted_engine(tok, text: str) -> HFEngine:
    script = tok.encode(text, add_special_tokens=False)
    filler = tok.encode("F", add_special_tokens=False)[0]
    return HFEngine(ScriptedLM(script, len(tok), prompt_len=4, filler=filler), tok)


def test_stop_eos_length_per_row(tok):
    engine = scripted_engine(tok, "I go <answer>Left</answer> and then <|im_end|>")
    chat = ChatFormat(tok)
    p = [5, 6, 7, 8]
    out = engine.generate(
        [
            GenerationRequest("stop", p, SamplingParams(max_new_tokens=30, stop=["</answer>"])),
            GenerationRequest("eos", p, SamplingParams(max_new_tokens=30, temperature=0)),
            GenerationRequest("len", p, SamplingParams(max_new_tokens=3, stop=["</answer>"])),
            GenerationRequest("multi", p, SamplingParams(max_new_tokens=30, stop=["eft</an"])),
        ]
    )
    stop, eos, length, multi = out
    assert stop.finish_reason == "stop" and stop.text == "I go <answer>Left</answer>"
    assert eos.finish_reason == "eos" and eos.token_ids[-1] == chat.eos_id
    assert eos.text == "I go <answer>Left</answer> and then <|im_end|>"
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    # a stop string spanning tokens: kept up to and including the token that completed it
    assert multi.finish_reason == "stop" and multi.text.endswith("</answer>")
    assert "eft</an" not in tok.decode(multi.token_ids[:-1])
    for c in out:
        assert len(c.logprobs) == len(c.token_ids)


def test_length_finish_and_abort_and_sleep(tok):
    engine = scripted_engine(tok, "Left Left Left")
    p = [5, 6, 7, 8]
    engine.abort(["gone"])
    engine.sleep()
    assert engine.is_sleeping
    engine.wake()
    out = engine.generate(
        [
            GenerationRequest("gone", p, SamplingParams(max_new_tokens=5)),
            GenerationRequest("kept", p, SamplingParams(max_new_tokens=5, stop=["Down"])),
        ]
    )
    assert out[0].finish_reason == "abort" and out[0].token_ids == []
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 5
    again = engine.generate([GenerationRequest("gone", p, SamplingParams(max_new_tokens=2))])
    assert again[0].finish_reason == "length"  # an abort applies once
    assert engine.stats()["aborted"] == 1 and engine.stats()["sleeps"] == 1
