"""Episode loop and trainer on the real tiny policy (no cluster): masks, log-probs, updates."""

from dataclasses import replace

import pytest
import torch

from rollart.config import AlgoConfig, TaskConfig, TinyModelConfig, TrainConfig
from rollart.engines.hf import HFEngine
from rollart.envs import ToyTextEnv, make_env
from rollart.envs.registry import ENV_BUILDERS, register_env
from rollart.models.chat import ChatFormat
from rollart.models.policy import build_tiny_model
from rollart.models.tokenizer import build_tokenizer
from rollart.rollout.env_manager import EpisodeSpec, constrained_params, run_episodes
from rollart.train.trainer import Trainer, collate
from rollart.types import SamplingParams

TASK = TaskConfig(max_turns=3)


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    tok = build_tokenizer(make_env(TASK).corpus_texts(episodes=5), 320)
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    return model, tok


def _specs(n: int, task: TaskConfig = TASK) -> list[EpisodeSpec]:
    return [EpisodeSpec(task, seed=i, group_id=f"g{i // 2}", sample_id=f"s{i}") for i in range(n)]


def test_trajectory_mask_logprobs_and_versions(policy):
    model, tok = policy
    engine = HFEngine(model, tok, seed=0, weight_version=7)
    chat = ChatFormat(tok)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop=["</answer>"])
    trajs = run_episodes(_specs(4), engine.generate, chat, params)
    assert len(trajs) == 4
    for t in trajs:
        n = len(t.token_ids)
        assert n == len(t.loss_mask) == len(t.behaviour_logprobs) == len(t.token_versions)
        assert 1 <= t.num_turns <= TASK.max_turns
        model_ids = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        # Exactly the generated tokens are unmasked, in order.
        assert tok.decode(model_ids, skip_special_tokens=False) == "".join(
            u.response for u in t.turns)
        assert {v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m} == {7}
        # The conversation starts with the system prompt and holds every observation.
        text = tok.decode(t.token_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n")
        assert all(u.observation in text for u in t.turns)
        # Behaviour log-probs equal a fresh forward pass over the whole conversation.
        with torch.no_grad():
            ids = torch.tensor([t.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            recomputed = logp.gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        got = torch.tensor(t.behaviour_logprobs[1:])[mask]
        assert torch.allclose(got, recomputed[mask], atol=1e-4)


def test_env_failure_costs_one_episode(policy):
    model, tok = policy

    class Crashy(ToyTextEnv):
        def step(self, action_text):
            if self._seed == 1:
                raise RuntimeError("sandbox died")
            return super().step(action_text)

        def reset(self, seed):
            self._seed = seed
            return super().reset(seed)

    @register_env("Crashy")
    def build(task):
        return Crashy("FrozenLake-v1", {"map_name": "4x4", "is_slippery": False}, task.max_turns)

    try:
        task = TaskConfig(name="crashy", env_id="Crashy-v0", max_turns=2)
        engine = HFEngine(model, tok, seed=0)
        trajs = run_episodes(_specs(3, task), engine.generate, ChatFormat(tok),
                             SamplingParams(max_new_tokens=4))
    finally:
        ENV_BUILDERS.pop("Crashy")
    assert [t.error is not None for t in trajs] == [False, True, False]
    assert "sandbox died" in trajs[1].error
    assert all(t.num_turns == 2 for t in (trajs[0], trajs[2]))


def test_update_moves_logprobs_along_advantage(policy):
    model, tok = policy
    model = build_tiny_model(TinyModelConfig(), tok, seed=1)
    engine = HFEngine(model, tok, seed=0)
    trajs = run_episodes(_specs(2), engine.generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    trajs[0].advantage, trajs[1].advantage = 1.0, -1.0
    trainer = Trainer(model, AlgoConfig(entropy_coef=0.0), TrainConfig(lr=1e-3, epochs=1),
                      pad_id=tok.pad_token_id)
    batch = collate(trajs, tok.pad_token_id)

    def seq_logp():
        with torch.no_grad():
            lp = trainer._logprobs(trainer.model, batch)
        return (lp * batch.loss_mask).sum(1)

    before = seq_logp()
    metrics = trainer.update(trajs)
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.version == 1
    assert metrics["train/logprob_mismatch"] < 1e-4  # engine and trainer share weights
    assert metrics["train/clip_frac"] == 0.0  # one epoch: ratio is exactly 1


def test_batch_without_signal_skips_its_passes_and_lands_where_they_would(policy):
    """All advantages 0 (every group scored alike): the update leaves out the forward and
    backward passes but steps AdamW along its moments, to exactly the weights and optimizer
    state the passes reach (their gradient is exactly 0)."""
    model, tok = policy
    trajs = run_episodes(_specs(4), HFEngine(model, tok, seed=0).generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    signal = [1.0, -1.0, 0.5, -0.5]

    def trained(skip: bool):
        m = build_tiny_model(TinyModelConfig(), tok, seed=3)
        tr = Trainer(m, AlgoConfig(entropy_coef=0.0), TrainConfig(lr=1e-2, epochs=2),
                     pad_id=tok.pad_token_id)
        if not skip:
            tr._no_signal = lambda trajs: False  # type: ignore[method-assign]
            tr._signal_rows = lambda trajs: trajs  # type: ignore[method-assign]
        for t, a in zip(trajs, signal, strict=True):
            t.advantage = a
        first = tr.update(trajs)  # moments now non-zero
        for t in trajs:
            t.advantage = 0.0
        before = [p.detach().clone() for p in m.parameters()]
        metrics = tr.update(trajs)
        return tr, before, metrics, first

    fast, before, m_fast, first = trained(skip=True)
    slow, _, m_slow, _ = trained(skip=False)
    assert "train/no_signal" not in first and m_fast["train/no_signal"] == 1.0
    assert "train/no_signal" not in m_slow and m_slow["train/grad_norm"] == 0.0
    assert m_fast["train/tokens"] == m_slow["train/tokens"]
    assert m_fast["train/sequences"] == m_slow["train/sequences"]
    assert fast.version == slow.version == 2
    moved = False
    for pf, ps, p0 in zip(fast.model.parameters(), slow.model.parameters(), before,
                          strict=True):
        assert torch.equal(pf, ps)  # bit for bit
        moved |= not torch.equal(pf, p0)  # momentum moved them
    assert moved
    for sf, ss in zip(fast.optimizer.state.values(), slow.optimizer.state.values(),
                      strict=True):
        assert all(torch.equal(sf[k], ss[k]) for k in sf)
    # Any term besides the surrogate (here an entropy bonus) needs the passes.
    tr = Trainer(build_tiny_model(TinyModelConfig(), tok, seed=3), AlgoConfig(entropy_coef=0.01),
                 TrainConfig(lr=1e-2), pad_id=tok.pad_token_id)
    assert "train/no_signal" not in tr.update(trajs)


@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "token_mean"])
def test_rows_without_signal_are_left_out_of_the_passes_and_the_gradient_stays(policy,
                                                                                 loss_agg):
    """A mixed batch: group g0 scored alike (advantages 0), g1 and g2 did not, and one member
    of g2 has advantage 0. Those three rows add exactly 0 to the loss and its gradient, so the
    passes run on the other three, with the whole batch's normalisers: in float64 the
    gradient and loss match the update over all six rows to rounding (~1e-16 relative per
    operation), and the model never sees the left-out rows."""
    model, tok = policy
    trajs = run_episodes(_specs(6), HFEngine(model, tok, seed=0).generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    for t, a in zip(trajs, [0.0, 0.0, 1.0, -1.0, 0.75, 0.0], strict=True):
        t.advantage = a

    def updated(left_out: bool):
        m = build_tiny_model(TinyModelConfig(), tok, seed=3).double()
        tr = Trainer(m, AlgoConfig(entropy_coef=0.0, off_policy="none", loss_agg=loss_agg),
                     TrainConfig(lr=1e-2, epochs=1, grad_clip=1e9), pad_id=tok.pad_token_id)
        if not left_out:
            tr._signal_rows = lambda rows: rows  # type: ignore[method-assign]
        rows_seen: list[int] = []
        # Every row the passes run goes through the decoder (once, or as its shared prefix's
        # [groups, L] and then [rows, T - L]).
        hook = m.base_model.register_forward_hook(lambda mod, args, kw, out: rows_seen.append(
            kw["input_ids"].shape[0] if "input_ids" in kw else args[0].shape[0]),
            with_kwargs=True)
        metrics = tr.update(trajs)
        hook.remove()
        return tr, metrics, rows_seen

    fast, m_fast, seen_fast = updated(left_out=True)
    slow, m_slow, seen_slow = updated(left_out=False)
    assert m_fast["train/rows_left_out"] == 3.0 and m_slow["train/rows_left_out"] == 0.0
    for k in ("train/sequences", "train/tokens"):
        assert m_fast[k] == m_slow[k]
    # By hand: one epoch, so every ratio is exactly 1 and a row's token loss is -A (the
    # advantages are exact in float32, as collate stores them); the
    # normalisers count all six rows (n_i model tokens each).
    adv = [t.advantage for t in trajs]
    n = [sum(t.loss_mask[1:]) for t in trajs]
    want = (-sum(adv) / 6 if loss_agg == "seq_mean_token_mean"
            else -sum(a * k for a, k in zip(adv, n, strict=True)) / sum(n))
    assert m_fast["train/loss"] == pytest.approx(want, rel=1e-12)
    assert m_fast["train/loss"] == pytest.approx(m_slow["train/loss"], rel=1e-12)
    assert m_fast["train/ratio_mean"] == pytest.approx(1.0)
    scale = max(float(p.grad.abs().max()) for p in slow.model.parameters())
    assert scale > 0
    for pf, ps in zip(fast.model.parameters(), slow.model.parameters(), strict=True):
        torch.testing.assert_close(pf.grad, ps.grad, rtol=0, atol=1e-12 * scale)
    assert max(seen_fast) == 3 and max(seen_slow) == 6


def test_vocab_logprobs_train_a_constrained_batch_as_if_it_were_sampled_freely(policy):
    """algo.constrained_logprobs: "restricted" scores each token under the bag it was sampled
    from (softmax over the bag: never below its whole-vocabulary log-prob), "vocab" over the
    whole vocabulary, so its update is the one on the same tokens sampled without a bag."""
    model, tok = policy
    trajs = run_episodes(_specs(2), HFEngine(model, tok, seed=0).generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    trajs[0].advantage, trajs[1].advantage = 1.0, -1.0
    bag = sorted({t for x in trajs for t, m in zip(x.token_ids, x.loss_mask, strict=True) if m})
    bagged = [replace(x, allowed_token_ids=bag) for x in trajs]

    def trainer(mode: str) -> Trainer:
        return Trainer(build_tiny_model(TinyModelConfig(), tok, seed=3),
                       AlgoConfig(entropy_coef=0.0, off_policy="none", constrained_logprobs=mode),
                       TrainConfig(lr=1e-2, epochs=1), pad_id=tok.pad_token_id)

    probe = trainer("restricted")
    vocab = probe._vocab_size()
    b_free, b_bag = collate(trajs, tok.pad_token_id, vocab), collate(bagged, tok.pad_token_id,
                                                                      vocab)
    lp_free, lp_bag = probe._logprobs(probe.model, b_free), probe._logprobs(probe.model, b_bag)
    sel = b_bag.loss_mask > 0
    assert len(bag) < vocab and bool((lp_bag[sel] > lp_free[sel]).all())

    def weights(mode: str, batch: list) -> list[torch.Tensor]:
        tr = trainer(mode)
        tr.update(batch)
        return [p.detach() for p in tr.model.parameters()]

    free = weights("restricted", trajs)
    assert all(torch.equal(a, b) for a, b in zip(free, weights("vocab", bagged), strict=True))
    assert not all(torch.equal(a, b)
                   for a, b in zip(free, weights("restricted", bagged), strict=True))


def test_collate_shifts_mask_to_targets(policy):
    _, tok = policy
    from rollart.types import Trajectory

    t = Trajectory("s", "t", "e", "g", 0, 0, token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1],
                   behaviour_logprobs=[0, 0, -0.5, -0.25], token_versions=[-1, -1, 0, 0],
                   advantage=2.0)
    short = Trajectory("s2", "t", "e", "g", 0, 0, token_ids=[5, 6], loss_mask=[0, 1],
                       behaviour_logprobs=[0, -1.0], token_versions=[-1, 0], advantage=-1.0)
    b = collate([t, short], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]]
    assert b.targets.tolist() == [[6, 7, 8], [6, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert b.behaviour_logprobs.tolist() == [[0, -0.5, -0.25], [-1.0, 0, 0]]
    assert b.advantages.tolist() == [2.0, -1.0]


def test_checkpoint_roundtrip_restores_weights_and_optimizer(policy):
    model, tok = policy
    model = build_tiny_model(TinyModelConfig(), tok, seed=2)
    tr = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=0)
    engine = HFEngine(model, tok, seed=0)
    trajs = run_episodes(_specs(2), engine.generate, ChatFormat(tok), SamplingParams(4))
    for t, a in zip(trajs, (1.0, -1.0), strict=True):
        t.advantage = a
    tr.update(trajs)
    files = tr.checkpoint_files()
    fresh = Trainer(build_tiny_model(TinyModelConfig(), tok, seed=3), AlgoConfig(),
                    TrainConfig(), pad_id=0)
    fresh.load_checkpoint_files(files)
    for (k, a), b in zip(tr.model.state_dict().items(), fresh.model.state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k
    assert fresh.version == 1
    assert fresh.optimizer.state_dict()["state"].keys() == tr.optimizer.state_dict()["state"].keys()
    got = fresh.optimizer.state_dict()["state"]
    for idx, a in tr.optimizer.state_dict()["state"].items():
        assert a.keys() == got[idx].keys() and all(torch.equal(a[k], got[idx][k]) for k in a)
    assert fresh.optimizer.state_dict()["param_groups"] == tr.optimizer.state_dict()["param_groups"]
    assert fresh.checkpoint_files() == files  # the same bytes again: nothing lost or re-typed


def test_on_done_fires_as_each_episode_ends(policy):
    model, tok = policy
    engine = HFEngine(model, tok, seed=3)
    calls = {"n": 0}

    def generate(reqs):
        calls["n"] += 1
        return engine.generate(reqs)

    seen: list[tuple[str, int, int]] = []
    task = TaskConfig(max_turns=4, constrained=True)  # actions flow: some episodes end early
    chat = ChatFormat(tok)
    params = constrained_params(SamplingParams(max_new_tokens=4), chat, [task])
    trajs = run_episodes(_specs(8, task), generate, chat, params,
                         on_done=lambda t: seen.append((t.sample_id, t.num_turns, calls["n"])))
    assert sorted(s for s, _, _ in seen) == sorted(t.sample_id for t in trajs)  # once each
    assert len({turns for _, turns, _ in seen}) > 1  # episodes of different lengths
    for _, turns, at_call in seen:
        assert at_call == turns  # called right after its last turn, not at the end of the batch


def test_kl_guard_scales_the_step_back_along_its_line(policy):
    """Same start, same batch: with the guard, theta = start + s * (unguarded - start) and the
    batch KL is at most max_kl; without it, a large lr takes a step far past max_kl."""
    model, tok = policy
    base = build_tiny_model(TinyModelConfig(), tok, seed=2)
    trajs = run_episodes(_specs(4), HFEngine(base, tok, seed=0).generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 else -1.0

    def run(max_kl: float):
        m = build_tiny_model(TinyModelConfig(), tok, seed=2)
        tr = Trainer(m, AlgoConfig(entropy_coef=0.0),
                     TrainConfig(lr=0.05, epochs=1, max_kl=max_kl), pad_id=tok.pad_token_id)
        metrics = tr.update(trajs)
        return [p.detach().clone() for p in m.parameters()], metrics, tr

    start = [p.detach().clone() for p in base.parameters()]
    free, m_free, _ = run(0.0)
    guarded, m_g, tr = run(0.01)
    assert "train/kl_update" not in m_free  # off by default
    assert m_g["train/kl_update"] > 0.05 > 0.01 >= m_g["train/kl_final"]
    s = m_g["train/kl_guard_scale"]
    assert 0.0 < s < 1.0
    for p0, pf, pg in zip(start, free, guarded, strict=True):
        torch.testing.assert_close(pg, p0 + s * (pf - p0), rtol=1e-5, atol=1e-6)
    # The reported final KL is the batch KL of the weights the trainer now holds.
    batch = collate([t for t in trajs if t.num_model_tokens], tok.pad_token_id, tr._vocab_size())
    plan = tr._micro_plan(batch)
    prox = torch.cat([tr._logprobs(base, mb) for _, mb, _ in plan])
    assert abs(tr._batch_kl(batch, plan, prox) - m_g["train/kl_final"]) < 1e-6


def test_split_head_logprobs_equal_the_full_forward(policy):
    """The trainer's forward (no attention mask, LM head on model tokens only) gives the same
    log-probs and entropies as the model's full output with the padding mask, on every model
    token; two float32 evaluations of the same sums, so equal to a few ulps of the logits."""
    from rollart.algo import entropy_from_logits, token_logprobs

    model, tok = policy
    engine = HFEngine(model, tok, seed=0)
    trajs = run_episodes(_specs(4), engine.generate, ChatFormat(tok),
                         SamplingParams(max_new_tokens=6))
    assert len({len(t.token_ids) for t in trajs}) > 1  # right padding is exercised
    trainer = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=tok.pad_token_id)
    batch = collate(trajs, tok.pad_token_id, trainer._vocab_size())
    with torch.no_grad():
        logp, ent = trainer._token_logprobs(model, batch, entropy=True)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        ref_lp = token_logprobs(full, batch.targets)
        ref_ent = entropy_from_logits(full)
    on = batch.loss_mask > 0
    assert on.sum() > 0 and bool((logp[~on] == 0).all()) and bool((ent[~on] == 0).all())
    torch.testing.assert_close(logp[on], ref_lp[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[on], ref_ent[on], rtol=0, atol=1e-5)


def test_answer_grammar_spells_whole_answers_with_matching_logprobs(policy):
    """Under the answer grammar every turn is one whole `<answer>{action}</answer>` + end of
    turn; the tags and the end are forced (log-prob exactly 0), so the action is the only
    choice, and the trainer's log-probs under the same per-position restriction equal the
    engine's (the float32 tolerance of test_trajectory_mask_logprobs_and_versions)."""
    model, tok = policy
    chat = ChatFormat(tok)
    task = TaskConfig(max_turns=3, constrained=True)
    params = constrained_params(SamplingParams(max_new_tokens=4), chat, [task], grammar=True)
    seqs = params[task.name].allowed_sequences
    assert seqs == [[*chat.encode(f"<answer>{a}</answer>"), chat.eos_id]
                    for a in ("Left", "Down", "Right", "Up")]
    trajs = run_episodes(_specs(8, task), HFEngine(model, tok, seed=1).generate, chat, params)
    actions = set()
    for t in trajs:
        assert t.allowed_sequences == seqs
        turn: list[int] = []
        for tok_id, m, lp in zip(t.token_ids + [-1], t.loss_mask + [0],
                                 t.behaviour_logprobs + [0.0], strict=True):
            if m:
                if len(turn) != 1:  # everything but the action is forced
                    assert lp == 0.0
                turn.append(tok_id)
            elif turn:
                assert turn in seqs
                actions.add(turn[1])
                turn = []
    assert len(actions) > 1  # the action is sampled, not fixed
    tr = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=tok.pad_token_id)
    batch = collate(trajs, tok.pad_token_id, tr._vocab_size())
    got = tr._logprobs(model, batch)
    sel = batch.loss_mask > 0
    assert torch.allclose(got[sel], batch.behaviour_logprobs[sel], atol=1e-4)
