"""Calculator tool-use env: hand-written episodes (exact observations and rewards), format
penalties, truncation, determinism, config, and the safe expression evaluator."""

import re
import time

import pytest

from rollart.config import TaskConfig
from rollart.envs import CalculatorEnv, Env, make_env
from rollart.envs.calculator import MAX_EXPR_CHARS, ToolError, calculate, safe_eval
from rollart.envs.toolcall import format_tool_call

HINT = ('Call the calculator as <tool_call>{"name": "calculate", "arguments": {"expression": '
        '"..."}}</tool_call> or give the final answer as <answer>N</answer>.')


def task(max_turns: int = 4, parser: str = "lenient", **env_kwargs) -> TaskConfig:
    return TaskConfig(name="calc", env_id="calculator", env_kwargs=env_kwargs,
                      max_turns=max_turns, format_penalty=-0.1, parser=parser)


def call(expression: str) -> str:
    return format_tool_call("calculate", {"expression": expression})


def test_tool_then_answer_episode_exact_observations_and_rewards():
    env = make_env(task())
    assert isinstance(env, Env) and isinstance(env, CalculatorEnv)
    obs, info = env.reset(seed=3)
    assert obs == "Compute 343 * 706." and info["answer"] == "242158"
    obs, r, terminated, truncated, info = env.step(call("343 * 706"))
    assert (obs, r, terminated, truncated) == ("<tool_response>\n242158\n</tool_response>", 0.0,
                                               False, False)
    assert info["action"] == "calculate(343 * 706)" and info["format_ok"] and info["tool_call"]
    obs, r, terminated, truncated, info = env.step("<answer>242158</answer><|im_end|>")
    assert (obs, r, terminated, truncated) == ("", 1.0, True, False)
    assert info["success"] and info["action"] == "answer(242158)" and info["turn"] == 2
    with pytest.raises(RuntimeError):
        env.step("<answer>242158</answer>")


def test_wrong_answer_ends_the_episode_without_reward():
    env = make_env(task())
    env.reset(seed=0)  # 964 * 494 = 476216
    obs, r, terminated, truncated, info = env.step("<answer>476000</answer>")
    assert (obs, r, terminated, truncated) == ("", 0.0, True, False) and not info["success"]


def test_malformed_turns_pay_the_penalty_and_truncate():
    env = make_env(task(max_turns=3))
    env.reset(seed=0)
    obs, r, terminated, truncated, info = env.step("964 times 494 is a lot.")
    assert (obs, r, terminated, truncated) == (HINT, -0.1, False, False)
    assert info["action"] is None and not info["valid"]
    obs, r, _, _, info = env.step('<tool_call>{"name": "python", "arguments": {}}</tool_call>')
    assert obs == f"Invalid tool call: unknown tool 'python'; available: calculate. {HINT}"
    assert r == -0.1
    obs, r, terminated, truncated, info = env.step("<answer>about 476 thousand</answer>")
    assert (obs, r, terminated, truncated) == ("", -0.1, False, True)


def test_lenient_turns_run_with_half_penalty_strict_parser_refuses_them():
    env = make_env(task())
    env.reset(seed=0)
    obs, r, _, _, info = env.step(f"Let me use the tool. {call('964*494')} Done.")
    assert obs == "<tool_response>\n476216\n</tool_response>" and r == pytest.approx(-0.05)
    obs, r, terminated, _, info = env.step("The answer is <answer>476,216</answer>.")
    assert (r, terminated, info["success"], info["format_ok"]) == (0.95, True, True, False)
    strict = make_env(task(parser="strict"))
    strict.reset(seed=0)
    obs, r, _, _, info = strict.step(f"Sure: {call('964*494')}")
    assert obs == f"Invalid tool call: write the call alone, nothing around it. {HINT}"
    assert r == -0.1 and info["action"] is None
    obs, r, _, _, _ = strict.step("So <answer>476216</answer>")
    assert (obs, r) == ("The answer must be a whole number, alone: <answer>N</answer>.", -0.1)


def test_first_action_in_the_text_wins():
    env = make_env(task())
    env.reset(seed=0)
    obs, r, terminated, _, info = env.step(f"<answer>1</answer> {call('964*494')}")
    assert (terminated, info["action"], r) == (True, "answer(1)", -0.05)
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(f"{call('2+2')} <answer>4</answer>")
    assert (obs, terminated) == ("<tool_response>\n4\n</tool_response>", False)


def test_tool_errors_are_tool_responses_not_format_errors():
    env = make_env(task())
    env.reset(seed=0)
    obs, r, _, _, info = env.step(call("1/0"))
    assert (obs, r, info["format_ok"]) == ("<tool_response>\nerror: division by zero\n"
                                           "</tool_response>", 0.0, True)
    obs, _, _, _, _ = env.step(call("__import__('os').system('true')"))
    assert obs == ("<tool_response>\nerror: only numbers and + - * / // % ( ) are allowed\n"
                   "</tool_response>")


def test_problems_are_seeded_and_follow_the_config():
    env, again = make_env(task()), make_env(task())
    problems = [env.reset(seed=s)[0] for s in range(30)]
    assert problems == [again.reset(seed=s)[0] for s in range(30)] and len(set(problems)) == 30
    for s in range(30):
        a, b = map(int, env.generate(s)[0].split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and env.generate(s)[1] == a * b
    mixed = make_env(task(digits=[4, 2, 1], ops=["+", "-"], terms=3))
    text, answer = mixed.generate(7)
    nums = text.replace("-", "+").split(" + ")
    assert [len(n) for n in nums] == [4, 2, 1] and answer == safe_eval(text)
    assert make_env(task(digits=2, ops=["-"])).generate(1)[1] >= 0


def test_bad_config_fails_clearly_and_constrained_builds():
    with pytest.raises(ValueError, match="unknown"):
        make_env(task(size=3))
    with pytest.raises(ValueError, match="ops"):
        make_env(task(ops=["/"]))
    with pytest.raises(ValueError, match="digits"):
        make_env(task(digits=[3, 3, 3]))
    # constrained: true samples under its action_grammar (tests/unit/test_action_grammar.py)
    env = make_env(TaskConfig(name="c", env_id="calculator", env_kwargs={}, constrained=True))
    assert env.action_names == [] and len(env.action_grammar) == 2


def test_system_prompt_shows_the_schema_and_a_one_shot_example():
    prompt = make_env(task()).system_prompt
    assert '"name": "calculate"' in prompt and '"required": ["expression"]' in prompt
    assert f"assistant: {call('12 * 34')}\nuser: <tool_response>\n408\n</tool_response>\n" \
        "assistant: <answer>408</answer>" in prompt


@pytest.mark.parametrize("expression, value", [
    ("123*45", 5535), ("(12 + 3) * 45", 675), ("-5 % 3", 1), ("10 // 3", 3), ("7 / 2", 3.5),
    ("-(2 - 9)", 7), ("+4", 4), ("1_000 * 2", 2000), ("3 × 4 − 1", 11), ("３４＊２", 68),
    ("  42 = ", 42), ("1.5 * 2", 3.0),
])
def test_safe_eval_allows_arithmetic(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("2 ** 10", "the ** operator is not supported"),
    ("2 ^ 10", "only numbers"),
    ("__import__('os')", "only numbers"),
    ("x + 1", "only numbers"),
    ("abs(-1)", "only numbers"),
    ("(1).real", "only numbers"),
    ("[1] * 3", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1 if 1 else 2", "only numbers"),
    ("(lambda: 1)()", "only numbers"),
    ("1 < 2", "only numbers"),
    ("1; 2", "invalid expression"),
    ("١٢٣ + 1", "invalid expression"),
    ("", "empty expression"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9" * 16, "number too large"),
    ("999999999999999 * 999999999999999 * 999999999999999", "result too large"),
    ("1e300 * 1e300", "number too large"),
    ("1 + " * 60 + "1", f"expression too long (over {MAX_EXPR_CHARS} characters)"),
    ("(" * 150 + "1" + ")" * 150, "expression too long"),
])
def test_safe_eval_refuses_everything_else(expression, error):
    with pytest.raises(ToolError, match=re.escape(error)):
        safe_eval(expression)
    assert calculate(expression).startswith("error: ")


def test_safe_eval_is_bounded_on_adversarial_input():
    t0 = time.perf_counter()
    for expression in ["9" * 10_000_000, "-" * 199 + "1", "(" * 99 + "1" + ")" * 99,
                       "*".join(["99999"] * 33), None]:
        calculate(expression)  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 1.0
    assert calculate("-" * 199 + "1") == "-1" and calculate("2/3") == "0.666666666667"
