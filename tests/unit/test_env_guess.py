"""Guess-the-number env: hand-written episodes (exact observations and rewards), parsing,
format penalties, truncation, determinism, registry and the constrained answer grammar."""

import pytest

from rollart.config import TaskConfig
from rollart.envs import Env, GuessEnv, make_env
from rollart.envs.guess import parse_guess

PROMPT = ("We play a guessing game. I am thinking of a secret whole number from 1 to 16. You have "
          "6 guesses. After each wrong guess I tell you whether the secret number is higher or "
          "lower. Reply with only your guess, written as <answer>N</answer>, for example "
          "<answer>8</answer>.")
HINT = ("I could not read a guess. Reply with only a whole number inside answer tags, for "
        "example <answer>{}</answer>.")


def task(max_turns: int = 6, parser: str = "lenient", format_credit: str = "graded",
         **env_kwargs) -> TaskConfig:
    return TaskConfig(name="guess", env_id="guess", env_kwargs=env_kwargs, max_turns=max_turns,
                      format_penalty=-0.1, parser=parser, format_credit=format_credit)


def test_binary_search_episode_exact_observations_and_rewards():
    env = make_env(task())
    assert isinstance(env, Env) and isinstance(env, GuessEnv)
    assert env.system_prompt == PROMPT
    obs, info = env.reset(seed=5)  # secret 9
    assert obs == "Guess the secret number from 1 to 16." and info == {"seed": 5, "max_turns": 6}
    steps = [
        ("<answer>8</answer>", "8 is too low. The secret number is higher, from 9 to 16.", 0.0),
        ("<answer>12</answer>", "12 is too high. The secret number is lower, from 9 to 11.", 0.0),
        ("<answer>10</answer>", "10 is too high. The secret number is lower, from 9 to 9.", 0.0),
    ]
    for turn, (action, expected, reward) in enumerate(steps, start=1):
        obs, r, terminated, truncated, info = env.step(action)
        assert (obs, r, terminated, truncated) == (expected, reward, False, False)
        assert info["turn"] == turn and info["format_ok"] and info["valid"]
        assert info["action"] == action[8:-9] and not info["success"]
    obs, r, terminated, truncated, info = env.step("<answer>9</answer><|im_end|>")
    assert (obs, r, terminated, truncated) == ("", 1.0, True, False)
    assert info["success"] and info["task_reward"] == 1.0 and info["format_penalty"] == 0.0
    with pytest.raises(RuntimeError):
        env.step("<answer>9</answer>")


def test_malformed_and_lenient_turns_pay_penalties_and_truncate():
    env = make_env(task(max_turns=3, show_range=False))
    env.reset(seed=1)  # secret 5
    obs, r, terminated, truncated, info = env.step("no idea")
    assert (obs, r, terminated, truncated) == (HINT.format(8), -0.1, False, False)
    assert info["action"] is None and not info["valid"] and info["format_penalty"] == -0.1
    obs, r, _, _, info = env.step("I guess 3, maybe.")  # lenient: bare integer, half penalty
    assert obs == "3 is too low. The secret number is higher than 3."
    assert r == pytest.approx(-0.05) and info["action"] == "3" and not info["format_ok"]
    obs, r, terminated, truncated, info = env.step("<answer>6</answer> final")
    assert (obs, terminated, truncated) == ("", False, True)
    assert r == pytest.approx(-0.05) and not info["success"] and info["turn"] == 3


def test_hint_after_malformed_turn_names_the_middle_of_the_remaining_range():
    env = make_env(task())
    env.reset(seed=0)  # secret 13
    env.step("<answer>10</answer>")
    assert env.step("")[0] == HINT.format(13)  # (11 + 16) // 2


def test_parser_strict_and_format_credit_action():
    strict = make_env(task(parser="strict"))
    strict.reset(seed=1)
    obs, r, _, _, info = strict.step("My guess: <answer>5</answer>")
    assert info["action"] is None and r == -0.1 and obs.startswith("I could not read")
    lenient = make_env(task(format_credit="action"))
    lenient.reset(seed=1)
    obs, r, terminated, _, info = lenient.step("It is 5")
    assert (r, terminated, info["format_ok"], info["success"]) == (1.0, True, False, True)


@pytest.mark.parametrize("text, lenient, strict", [
    ("<answer>7</answer>", (7, True), (7, True)),
    ("  <answer> 7 </answer>\n<|im_end|>", (7, True), (7, True)),
    ("<think>8 or 9?</think> <answer>9</answer>", (9, True), (9, True)),
    ("<answer>1,024</answer>", (1024, True), (1024, True)),
    ("<answer>-3.</answer>", (-3, True), (-3, True)),
    ("Sure! <answer>7</answer>", (7, False), (None, False)),
    ("<answer>7</answer><answer>9</answer>", (7, False), (None, False)),  # first tag wins
    ("<answer>seven</answer> <answer>9</answer>", (9, False), (None, False)),
    ("<answer>N</answer> then 5", (5, False), (None, False)),
    ("The correct answer is 2. The answer is 1.", (2, False), (None, False)),
    ("<answer>7", (7, False), (None, False)),  # unclosed: bare integer
    ("3.5", (None, False), (None, False)),
    ("Maybe 1,024 or 2, 4, 6", (1024, False), (None, False)),
    ("no digits", (None, False), (None, False)),
    ("", (None, False), (None, False)),
    ("<answer></answer>", (None, False), (None, False)),
])
def test_parse_guess(text, lenient, strict):
    assert parse_guess(text, "lenient") == lenient
    assert parse_guess(text, "strict") == strict


def test_parse_never_raises():
    for text in [None, 42, "<answer>" * 10_000, "9" * 100_000, "<answer>\x00</answer>", "٣"]:
        parse_guess(text)  # type: ignore[arg-type]
    assert parse_guess("<answer>" + "9" * 50 + "</answer>") == (None, False)


def test_reset_is_deterministic_per_seed_and_covers_the_range():
    env, other = make_env(task()), make_env(task())
    secrets = []
    for seed in range(200):
        env.reset(seed)
        other.reset(seed)
        assert env.secret == other.secret
        secrets.append(env.secret)
    assert set(secrets) == set(range(1, 17))
    wide = make_env(task(low=100, high=199))
    assert wide.reset(3)[0] == "Guess the secret number from 100 to 199."
    assert 100 <= wide.secret <= 199


def test_bad_config_fails_clearly():
    with pytest.raises(ValueError, match="unknown"):
        make_env(task(size=4))
    with pytest.raises(ValueError, match="low <= high"):
        make_env(task(low=5, high=4))
    with pytest.raises(ValueError, match="map_name"):
        make_env(TaskConfig(name="g", env_id="guess"))  # the task default is FrozenLake's


def test_action_names_are_the_finite_answer_language_of_constrained_decoding():
    # `constrained: true` samples `<answer>{name}</answer>` + end of turn for each action name
    # (rollart.rollout.env_manager.answer_sequences; not imported here: it pulls in
    # transformers, ~10 s): every such turn must parse, strictly, as that guess.
    env = make_env(task(low=3, high=12))
    assert env.action_names == [str(k) for k in range(3, 13)]
    for name in env.action_names:
        assert parse_guess(f"<answer>{name}</answer>", "strict") == (int(name), True)
    env.reset(0)
    assert env.step(f"<answer>{env.secret}</answer>")[1:3] == (1.0, True)
