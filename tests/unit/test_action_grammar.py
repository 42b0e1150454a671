"""The token grammar (rollart.action_grammar) end to end: the language it allows, the run's
constrained params for an env with an `action_grammar`, the HF engine sampling under it, and the
trainer re-applying the engine's per-position restriction (log-probs equal the engine's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rollart.action_grammar import (
    TokenGrammar,
    TokenTexts,
    dump_grammar,
    token_grammar,
    token_texts,
    turn_walker,
)
from rollart.answer_trie import AnswerTrie
from rollart.config import AlgoConfig, TaskConfig, TinyModelConfig, TrainConfig
from rollart.engines.hf import HFEngine
from rollart.envs.calculator import CalculatorEnv
from rollart.envs.toolcall import format_tool_call
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model
from rollart.models.tokenizer import build_tokenizer
from rollart.rollout.env_manager import EpisodeSpec, constrained_params, run_episodes
from rollart.train.trainer import Trainer, collate
from rollart.types import GenerationRequest, SamplingParams

CALC = TaskConfig(name="calc", env_id="calculator", env_kwargs={}, max_turns=3,
                  max_new_tokens=120, constrained=True)
STOP = ["</answer>", "</tool_call>"]
# The calculator's strict turns, as text (its action_grammar; EXPR_CHARS, 1..40 and 1..12).
TURN = re.compile(r'<tool_call>\{"name": "calculate", "arguments": \{"expression": '
                  r'"[0-9+\-*/() ]{1,40}"\}\}</tool_call>|<answer>[0-9]{1,12}</answer>')
SMOLLM2 = Path.home() / ".cache/rollart/models/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    tok = build_tokenizer(CalculatorEnv().corpus_texts(episodes=20), 320)
    return build_tiny_model(TinyModelConfig(), tok, seed=0), tok


def test_token_grammar_allows_exactly_the_language():
    # A toy vocabulary: every printable ASCII character, a few merges, and an end token.
    vocab = [chr(c) for c in range(32, 127)] + ['{"', '":', ' "', "calculate", "<answer>",
                                                 "12", ' "3', '"}}', "ab", "<|im_end|>"]
    eos = len(vocab) - 1
    grammar = TokenGrammar(CalculatorEnv().action_grammar, vocab, eos)
    ids = {text: i for i, text in enumerate(vocab)}

    def walk(pieces: list[str]) -> list[tuple[int, ...]]:
        tokens = [ids[p] for p in pieces]
        return [grammar.allowed_next(tokens[:k]) for k in range(len(tokens) + 1)]

    assert [vocab[t] for t in grammar.allowed_next([])] == ["<", "<answer>"]
    answer = walk(["<answer>", "12", "3", "<", "/", *"answer>"])
    assert ids["12"] in answer[1] and ids["<"] in answer[2] and ids["a"] not in answer[2]
    assert answer[-1] == (eos,)  # complete: only end of turn
    assert ids["<"] not in walk(["<answer>"])[-1]  # at least one digit
    call = format_tool_call("calculate", {"expression": "7*3"})
    pieces = ["<", *"tool_call>", '{"', *"name", '":', ' "', "calculate", '"', ",", ' "',
              *"arguments", '":', " ", "{", '"', *"expression", '":', ' "', "7", "*", "3",
              '"}}', *"</tool_call>"]
    assert "".join(pieces) == call
    steps = walk(pieces)
    assert all(ids[p] in allowed for p, allowed in zip(pieces, steps, strict=False))
    assert steps[-1] == (eos,)
    expr = steps[pieces.index("7")]
    # the expression's characters, "12", and ' "' (a space, then the closing quote); never
    # ' "3' (a digit where the literal continues with "}}")
    assert {vocab[t] for t in expr} == set("0123456789+-*/() ") | {"12", ' "'}
    assert grammar.allowed_next([ids["ab"]]) == (eos,)  # off the grammar: end the turn
    long_expr = walk(pieces[:pieces.index("7")] + ["1"] * 40)
    assert ids["1"] not in long_expr[-1] and ids['"}}'] in long_expr[-1]  # 40 chars at most
    # The bag: every token of the grammar's alphabet, and end of turn; never "ab".
    assert eos in grammar.bag and ids['"}}'] in grammar.bag and ids["ab"] not in grammar.bag


def test_grammar_string_is_cached_per_vocabulary_and_checked_against_it(policy):
    _, tok = policy
    texts = token_texts(tok)
    assert texts is token_texts(tok)  # decoded once per tokenizer
    assert texts.texts[tok.eos_token_id] == ""  # special tokens are never grammar tokens
    # Concatenated token texts are the decoded text: the grammar's view is the env's view.
    ids = ChatFormat(tok).encode(format_tool_call("calculate", {"expression": "12 * 34"}))
    assert "".join(texts.texts[i] for i in ids) == tok.decode(ids)
    text = dump_grammar(CalculatorEnv().action_grammar, 3, texts)
    assert token_grammar(text, texts) is token_grammar(text, TokenTexts.of(texts.texts))
    other = TokenTexts.of([*texts.texts[:-1], "x"])
    with pytest.raises(ValueError, match="vocabulary"):
        token_grammar(text, other)
    # One precedence for engine and trainer: token grammar, answer trie, then the bag alone.
    assert isinstance(turn_walker(text, [[1, 2]], texts), TokenGrammar)
    assert isinstance(turn_walker(None, [[1, 2]], None), AnswerTrie)
    assert turn_walker(None, None, None) is None
    with pytest.raises(ValueError, match="token texts"):
        turn_walker(text, None, None)


def test_constrained_params_give_the_grammar_and_its_bag(policy):
    _, tok = policy
    chat = ChatFormat(tok)
    hf = constrained_params(SamplingParams(stop=STOP), chat, [CALC], grammar=True)["calc"]
    grammar = token_grammar(hf.grammar, token_texts(tok))
    assert hf.allowed_sequences is None and hf.max_new_tokens == 120
    assert hf.allowed_token_ids == list(grammar.bag) and chat.eos_id in hf.allowed_token_ids
    # Engines that cannot walk a grammar (vLLM) get the bag alone.
    bag = constrained_params(SamplingParams(), chat, [CALC], grammar=False)["calc"]
    assert bag.grammar is None and bag.allowed_token_ids == hf.allowed_token_ids
    free = CALC.model_copy(update={"constrained": False})
    assert constrained_params(SamplingParams(), chat, [free], grammar=True)["calc"].grammar \
        is None
    arith = TaskConfig(name="a", env_id="arith", env_kwargs={}, constrained=True)
    with pytest.raises(ValueError, match="action_grammar"):  # not a bag of end of turn alone
        constrained_params(SamplingParams(), chat, [arith])


def test_hf_engine_under_the_grammar_only_emits_grammar_valid_turns(policy):
    model, tok = policy
    chat = ChatFormat(tok)
    params = constrained_params(SamplingParams(temperature=1.0), chat, [CALC], grammar=True)
    prompt = chat.first_prompt(CalculatorEnv().system_prompt, "Compute 347 * 268.")
    reqs = [GenerationRequest(f"r{i}", prompt, params["calc"]) for i in range(48)]
    kinds = set()
    for c in HFEngine(model, tok, seed=0).generate(reqs):
        assert c.finish_reason == "eos", c.text  # the grammar always closes the turn
        assert c.text.endswith("<|im_end|>") and TURN.fullmatch(c.text[:-len("<|im_end|>")])
        assert set(c.token_ids) <= set(params["calc"].allowed_token_ids)
        kinds.add(c.text[:4])
    assert kinds == {"<too", "<ans"}  # a random policy samples both alternatives
    # Unconstrained, the same policy never writes one.
    free = [GenerationRequest(r.request_id, prompt, SamplingParams(max_new_tokens=120))
            for r in reqs[:8]]
    assert not any(TURN.search(c.text) for c in HFEngine(model, tok, seed=0).generate(free))


def _episodes(model, tok, n: int = 6):
    chat = ChatFormat(tok)
    params = constrained_params(SamplingParams(temperature=1.0, stop=STOP), chat, [CALC],
                                grammar=True)
    specs = [EpisodeSpec(CALC, seed=i, group_id=f"g{i // 2}", sample_id=f"s{i}")
             for i in range(n)]
    trajs = run_episodes(specs, HFEngine(model, tok, seed=1).generate, chat, params,
                         max_context=2048)
    return trajs, params["calc"]


def test_trainer_recomputes_the_engines_logprobs_under_the_grammar(policy):
    """The trainer's per-position restriction is the engine's: its recomputed log-probs equal
    the behaviour log-probs (float32 tolerance, as for the answer trie), and forced tokens
    have log-prob exactly 0. Without the restriction they are far apart."""
    model, tok = policy
    trajs, params = _episodes(model, tok)
    assert all(t.grammar == params.grammar and t.error is None for t in trajs)
    assert all(TURN.fullmatch(u.response.removesuffix("<|im_end|>")) for t in trajs
               for u in t.turns)
    tr = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=tok.pad_token_id,
                 token_texts=token_texts(tok))
    batch = collate(trajs, tok.pad_token_id, tr._vocab_size(), tr.token_texts)
    sel = batch.loss_mask > 0
    got, mu = tr._logprobs(model, batch)[sel], batch.behaviour_logprobs[sel]
    assert torch.allclose(got, mu, atol=1e-4), float((got - mu).abs().max())
    assert (mu == 0).sum() > 10  # forced tokens (a literal with one way on)
    assert bool((got[mu == 0] == 0).all())
    free = tr._logprobs(model, collate(trajs, tok.pad_token_id))[sel]
    assert float((free - mu).abs().max()) > 1.0
    with pytest.raises(ValueError, match="token texts"):  # never silently the wrong masks
        collate(trajs, tok.pad_token_id, tr._vocab_size())


def test_trainer_update_applies_the_grammar_it_was_given(policy):
    model, tok = policy
    trajs, _ = _episodes(model, tok, n=4)
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 else -1.0
    tr = Trainer(build_tiny_model(TinyModelConfig(), tok, seed=0), AlgoConfig(),
                 TrainConfig(epochs=1), pad_id=tok.pad_token_id, token_texts=token_texts(tok))
    assert tr.update(trajs)["train/logprob_mismatch"] < 1e-5


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="SmolLM2 not fetched "
                    "(rollart models fetch smollm2-135m-instruct)")
def test_grammar_masks_match_with_smollm2_tokenizer():
    """SmolLM2's byte-level BPE (49,152 tokens, merges like '":' and ' "'), on a tiny random
    Llama over that vocabulary: grammar-valid turns, trainer log-probs equal the engine's."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(SMOLLM2, local_files_only=True)
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    trajs, _ = _episodes(model, tok, n=4)
    assert all(TURN.fullmatch(u.response.removesuffix("<|im_end|>")) for t in trajs
               for u in t.turns)
    tr = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=tok.pad_token_id,
                 token_texts=token_texts(tok))
    batch = collate(trajs, tok.pad_token_id, tr._vocab_size(), tr.token_texts)
    sel = batch.loss_mask > 0
    got, mu = tr._logprobs(model, batch)[sel], batch.behaviour_logprobs[sel]
    assert torch.allclose(got, mu, atol=1e-4), float((got - mu).abs().max())


def test_malformed_tool_calls_unconstrained_are_penalised_turns_not_crashes(policy):
    """constrained: false, the policy writes anything: each malformed call (cut-off or broken
    JSON, nested tags, unknown tool, no block, an over-long call) is one turn with the
    format penalty and feedback, and the episode runs to its turn limit without an error."""
    _, tok = policy
    chat = ChatFormat(tok)
    free = CALC.model_copy(update={"constrained": False, "max_turns": 6})
    params = constrained_params(SamplingParams(max_new_tokens=120, stop=STOP), chat, [free],
                                grammar=True)
    assert params["calc"].grammar is None and params["calc"].allowed_token_ids is None
    texts = ['<tool_call>{"name": "calculate", "arguments": {"expr',
             '<tool_call>{"name": calculate}</tool_call>',
             '<tool_call><tool_call>{"name": "calculate"}</tool_call>',
             '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
             "The answer is 5535.<|im_end|>",
             '<tool_call>{"name": "calculate", "arguments": {"expression": "'
             + "9" * 2000 + '"}}</tool_call>']

    def generate(reqs: list[GenerationRequest]):
        from rollart.types import Completion

        out = []
        for r in reqs:
            text = texts[int(r.request_id.rsplit("#t", 1)[1])]
            ids = chat.encode(text)
            out.append(Completion(r.request_id, ids, [0.0] * len(ids), tok.decode(ids),
                                  "length", 0))
        return out

    spec = EpisodeSpec(free, seed=0, group_id="g", sample_id="s")
    [traj] = run_episodes([spec], generate, chat, params, max_context=100_000)
    assert traj.error is None and traj.truncated and traj.num_turns == 6
    assert [u.action for u in traj.turns] == [None] * 6
    assert [u.env_reward for u in traj.turns] == [-0.1] * 6
    assert traj.format_errors == 6 and traj.format_penalty == pytest.approx(-0.6)
    assert all("<tool_call>" in u.observation or u.index == 0 for u in traj.turns)
