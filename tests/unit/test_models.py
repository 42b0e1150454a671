"""Tokenizer, chat format and tiny policy: round-trips, exact chat tokenization, determinism."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from transformers import AutoTokenizer

from rollart.config import ModelConfig, TinyModelConfig
from rollart.models import (
    ChatFormat,
    build_tiny_model,
    build_tokenizer,
    load_policy,
    param_count,
    save_hf_dir,
)

torch.set_num_threads(1)

SYSTEM = (
    "You are playing FrozenLake on a grid. S is the start, F is frozen ice, H is a hole, G is "
    "the goal and P is you. Reply with one action: Left, Down, Right or Up, in the format "
    "<answer>Left</answer>."
)
GRIDS = ["PFFF\nFHFH\nFFFH\nHFFG", "SFFF\nFHPH\nFFFH\nHFFG", "SFFF\nFHFH\nFFPH\nHFFG"]
CORPUS = (
    [SYSTEM]
    + [f"Turn {t}:\n{g}\nYou have {8 - t} actions left." for t in range(1, 8) for g in GRIDS]
    + [f"<answer>{a}</answer>" for a in ("Left", "Down", "Right", "Up")] * 5
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, 320)


def test_tokenizer_roundtrip_and_size(tok):
    assert 160 < len(tok) <= 320  # at most vocab_size: merges stop when pairs get rare
    rich = CORPUS + [f"Turn {i}: You have {i * 7} actions left." for i in range(300)]
    assert len(build_tokenizer(rich, 320)) == 320
    texts = CORPUS + ["  two  spaces \n\n trailing ", "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./", "\t"]
    for s in texts:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.encode("abc", add_special_tokens=True) == tok.encode("abc", add_special_tokens=False)
    assert tok.unk_token_id in tok.encode("café", add_special_tokens=False)  # non-ASCII -> <unk>


def test_tokenizer_specials_and_frequent_words(tok):
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id is not None and tok.pad_token_id != tok.eos_token_id
    for t in ["<|im_start|>", "<|im_end|>", "<answer>", "</answer>", "<think>", "</think>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    ids = tok.encode("<answer>Left</answer>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["<answer>", "Left", "</answer>"]
    # added tags are not special: decoding with skip_special_tokens keeps them
    ids = tok.encode("<answer>Up</answer><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<answer>Up</answer>"
    for word in ["Turn", "▁actions", "▁left.", "assistant", "system", "user"]:
        assert word in tok.get_vocab(), word


def test_tokenizer_deterministic_and_save_load(tok, tmp_path):
    again = build_tokenizer(CORPUS, 320)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CORPUS[1]}]
    for s in CORPUS[:5]:
        assert loaded.encode(s) == tok.encode(s)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    a = loaded.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert a == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert a.endswith("<|im_start|>assistant\n")


def _ids(enc):
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


@pytest.mark.parametrize("answer", ["<answer>Left</answer>", "I go\nright <answer>Right</answer>"])
def test_chat_format_matches_template(tok, answer):
    chat = ChatFormat(tok)
    user = CORPUS[3]
    ids = chat.system(SYSTEM) + chat.user(user) + chat.assistant_header()
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        add_generation_prompt=True,
    )
    assert ids == _ids(prompt)
    answer_ids = tok.encode(answer, add_special_tokens=False)
    full = ids + answer_ids + chat.assistant_end()
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    assert full == _ids(tok.apply_chat_template(msgs, tokenize=True))
    assert tok.decode(full) == tok.apply_chat_template(msgs, tokenize=False)
    # the model closing its own turn with <|im_end|> gives the same tokens
    assert ids + answer_ids + [chat.eos_id] + chat.end_after_eos() == full
    assert chat.eos_id == tok.eos_token_id
    assert tok.decode(chat.assistant_end()) == "<|im_end|>\n"


def test_tiny_model_config_and_determinism(tok):
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelConfig(hidden_size=64, num_heads=4)
    cfg = TinyModelConfig()
    a, b, c = (build_tiny_model(cfg, tok, s) for s in (0, 0, 1))
    assert a.config.head_dim == 32 and a.config.vocab_size == len(tok)
    assert a.config.tie_word_embeddings and a.lm_head.weight is a.model.embed_tokens.weight
    assert a.dtype == torch.float32
    n = param_count(a)
    # embeddings (tied) + per layer: 4 attn projections, 3 MLP matrices, 2 norms; final norm
    per_layer = 4 * 64 * 64 + 3 * 64 * 256 + 2 * 64
    assert n == len(tok) * 64 + 2 * per_layer + 64
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(sa[key], sc[key])


def test_save_and_reload_hf_dir(tmp_path):
    model, tok = load_policy(ModelConfig(), CORPUS, seed=3)
    save_hf_dir(model, tok, tmp_path / "policy")
    model2, tok2 = load_policy(ModelConfig(source="hf_dir", path=str(tmp_path / "policy")), None, 0)
    x = torch.tensor([tok.encode(CORPUS[2])])
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, model2.eval()(x).logits)
    assert tok2.encode(CORPUS[2]) == tok.encode(CORPUS[2])
    with pytest.raises(ValueError, match="corpus"):
        load_policy(ModelConfig(), None, 0)


def _file_maps(name: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files called `name` (/proc/self/maps)."""
    spans = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("/" + name):
            lo, hi = line.split()[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    return spans


def test_reloaded_weights_do_not_live_in_the_file_map(tmp_path):
    """An optimizer step writes the weights in place: they must not be pages of a
    copy-on-write map of model.safetensors (each would be copied on its first write)."""
    model, tok = load_policy(ModelConfig(), CORPUS, seed=3)
    save_hf_dir(model, tok, tmp_path / "policy")
    model2, _ = load_policy(ModelConfig(source="hf_dir", path=str(tmp_path / "policy")), None, 0)
    spans = _file_maps("model.safetensors")
    inside = [n for n, p in model2.named_parameters()
              if any(lo <= p.data_ptr() < hi for lo, hi in spans)]
    assert inside == []
    emb = model2.get_input_embeddings().weight
    assert model2.get_output_embeddings().weight is emb  # tied weights stay tied


@pytest.mark.parametrize(("backend", "loads_weights"), [("vllm", False), ("hf", True)])
def test_an_engine_service_loads_an_hf_directory_only_for_an_engine_that_serves_it(
        tmp_path, monkeypatch, backend, loads_weights):
    """vLLM reads the directory itself: the engine service builds the architecture without
    weights (for its parameter count); the HF engine serves the module it is given."""
    import rollart.engines
    import rollart.models.policy as policy
    from rollart.config import load_config
    from rollart.run import RunSpec
    from rollart.services.engine import EngineService

    model, tok = load_policy(ModelConfig(), CORPUS, seed=3)
    save_hf_dir(model, tok, tmp_path / "policy")
    cfg = load_config(None, [f"storage.root={tmp_path / 'store'}", "model.source=hf_dir",
                             f"model.path={tmp_path / 'policy'}", f"engine.backend={backend}"])
    loaded, served = [], []
    real_load = policy.load_policy
    monkeypatch.setattr(policy, "load_policy",
                        lambda *a, **k: loaded.append(1) or real_load(*a, **k))

    class Served:
        weight_version = -1

    monkeypatch.setattr(rollart.engines, "make_engine",
                        lambda cfg, model, tok, **kw: served.append(model) or Served())
    svc = EngineService(RunSpec(cfg, "engine-build"), 0)
    assert bool(loaded) == loads_weights
    assert all(p.is_meta for p in served[0].parameters()) != loads_weights
    assert svc.param_count() == param_count(model)
