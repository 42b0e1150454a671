"""Arithmetic env: seeded problems, math-verified answers, format penalty, registry, episodes."""

import pytest

from rollart.config import TaskConfig
from rollart.envs import ArithEnv, Env, make_env


def task(**kw) -> TaskConfig:
    return TaskConfig(name="arith", env_id="arith", env_kwargs=kw, max_turns=1,
                      format_penalty=-0.1)


def test_problems_are_seeded_and_respect_difficulty():
    env = make_env(task(min_value=10, max_value=99, ops=["*"], terms=3))
    assert isinstance(env, Env) and isinstance(env, ArithEnv)
    obs, info = env.reset(seed=4)
    assert obs == env.reset(seed=4)[0] and obs.startswith("Compute ") and obs.count("*") == 2
    nums = [int(x) for x in obs.removeprefix("Compute ").rstrip(".").split(" * ")]
    assert all(10 <= n <= 99 for n in nums) and int(info["answer"]) == nums[0] * nums[1] * nums[2]
    sub = make_env(task(ops=["-"]))
    assert all(sub.generate(s)[1] >= 0 for s in range(50))  # no negative results by default
    assert len({env.reset(seed=s)[0] for s in range(20)}) > 15


def test_rewards_by_math_verification_and_format():
    env = make_env(task())
    _, info = env.reset(seed=1)
    gold = info["answer"]
    cases = {
        f"{env.problem} = {gold}. <answer>{gold}</answer>": (1.0, True),
        f"The sum is {gold}.": (0.9, True),  # correct, untagged: format penalty
        f"<answer>{int(gold) + 1}</answer>": (0.0, False),
        "I do not know.": (-0.1, False),
    }
    for text, (reward, success) in cases.items():
        env.reset(seed=1)
        obs, r, terminated, truncated, step_info = env.step(text)
        assert (obs, terminated, truncated) == ("", True, False)
        assert r == pytest.approx(reward) and step_info["success"] is success, text
    with pytest.raises(RuntimeError):
        env.step("again")  # single turn


def test_unknown_kwargs_fail_clearly():
    with pytest.raises(ValueError, match="map_name"):
        make_env(TaskConfig(name="a", env_id="arith"))  # the task default is FrozenLake's
    with pytest.raises(ValueError, match="ops"):
        make_env(task(ops=["/"]))


def test_corpus_texts_cover_prompts_and_answers():
    texts = make_env(task()).corpus_texts(episodes=3)
    assert any("<answer>" in t for t in texts) and any(t.startswith("Compute") for t in texts)
