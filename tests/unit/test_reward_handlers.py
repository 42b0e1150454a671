"""Reward handlers as plain functions (the Lambda signature), incl. malicious code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollart.rewards.code_exec import code_exec, extract_code
from rollart.rewards.format_reward import format_reward
from rollart.rewards.math_reward import math_answer
from rollart.rewards.model_reward import reward_model, tiny_classifier
from rollart.rewards.registry import (
    _REGISTERED,
    BUILTINS,
    HANDLERS,
    get_handler,
    handler_path,
    known_handler,
    register_handler,
)

ADD = [{"input": "1 2", "output": "3"}, {"input": "5 7", "output": "12"}]


def test_registry_names_and_lambda_handler_paths():
    assert {"env_outcome", "success", "format", "math", "code_exec", "reward_model",
            "sleep"} <= set(HANDLERS)
    assert handler_path("env_outcome") == "rollart.rewards.handlers.env_outcome"
    assert handler_path("math") == "rollart.rewards.math_reward.math_answer"
    assert get_handler("rollart.rewards.format_reward.format_reward") is format_reward
    with pytest.raises(KeyError, match="known"):
        get_handler("no_such_reward")


def test_builtin_table_names_the_functions_it_resolves_to():
    assert set(BUILTINS) <= set(HANDLERS)
    for name, path in BUILTINS.items():
        fn = get_handler(name)
        assert f"{fn.__module__}.{fn.__name__}" == path == handler_path(name)


def test_duplicate_reward_names_raise_like_the_loss_registry():
    with pytest.raises(ValueError, match="'env_outcome' is already registered"):
        register_handler("env_outcome")(lambda event, context=None: {"reward": 0.0})
    name = f"custom_{uuid.uuid4().hex[:8]}"
    try:
        fn = register_handler(name)(lambda event, context=None: {"reward": 2.0})
        assert get_handler(name) is fn and name in HANDLERS and known_handler(name)
        with pytest.raises(ValueError, match="already registered"):
            register_handler(name)(lambda event, context=None: {"reward": 3.0})
        assert get_handler(name)({})["reward"] == 2.0  # the first one stays
    finally:
        _REGISTERED.pop(name, None)


def test_a_lambda_worker_imports_only_its_handler_module():
    """awslambdaric imports the `Handler` module; resolving a name imports only its module."""
    heavy = ["torch", "sympy", "math_verify", "transformers", "rollart.rewards.math_reward",
             "rollart.rewards.model_reward", "rollart.rewards.code_exec"]
    code = ("import sys; import rollart.rewards.handlers as h; "
            "lambda_path = 'rollart.rewards.registry' in sys.modules; "
            "from rollart.rewards.registry import get_handler, handler_path; "
            "assert get_handler('env_outcome') is h.env_outcome; "
            "assert handler_path('math') == 'rollart.rewards.math_reward.math_answer'; "
            f"print(lambda_path, [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60, check=True)
    assert out.stdout.split() == ["False", "[]"], out.stdout + out.stderr


def test_format_reward_is_graded():
    assert format_reward({"response": "<answer>Left</answer>"})["reward"] == 1.0
    partial = format_reward({"response": "I go <answer>Left</answer> now"})
    assert partial["reward"] == 0.5 and partial["format_exact"] == 0.0
    assert format_reward({"final_response": "Left"})["reward"] == 0.0
    two = {"response": "<think>hm</think> <answer>4</answer>", "tags": ["think", "answer"]}
    assert format_reward(two)["reward"] == 1.0
    assert format_reward({**two, "response": "<answer>4</answer>"})["reward"] == 0.25


@pytest.mark.parametrize("response,answer,reward", [
    ("The result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<answer>2x+2</answer>", "2(x+1)", 1.0),
    ("so the answer is $\\sqrt{4}$", "2", 1.0),
    ("\\boxed{3}", "2", 0.0),
])
def test_math_verify(response, answer, reward):
    out = math_answer({"response": response, "answer": answer})
    assert out["reward"] == reward and out["parsed"] == 1.0


def test_math_unparseable_and_bad_gold():
    assert math_answer({"response": "no idea", "answer": "2"}) == \
        {"reward": 0.0, "correct": 0.0, "parsed": 0.0}
    with pytest.raises(ValueError, match="gold"):
        math_answer({"response": "1", "answer": ""})


def test_code_exec_scores_tests():
    ok = code_exec({"code": "a, b = map(int, input().split())\nprint(a + b)", "tests": ADD})
    assert ok["reward"] == 1.0 and ok["passed"] == 2.0
    half = code_exec({"code": "print(3)", "tests": ADD})
    assert half["reward"] == 0.5
    fenced = "Here:\n```python\nprint(sum(map(int, input().split())))\n```\n"
    assert extract_code({"response": fenced}).startswith("print(sum")
    assert code_exec({"response": fenced, "tests": ADD})["reward"] == 1.0
    syntax = code_exec({"code": "def f(:\n", "tests": ADD[:1]})
    assert syntax["reward"] == 0.0 and syntax["syntax_error"] == 1.0
    asserts = code_exec({"code": "def f(x):\n    return 2 * x", "test_code": "assert f(3) == 6"})
    assert asserts["reward"] == 1.0


def test_code_exec_early_exit_does_not_pass_asserts():
    out = code_exec({"code": "import sys\nsys.exit(0)\ndef f(x): return 0",
                     "test_code": "assert f(3) == 6"})
    assert out["reward"] == 0.0


def test_infinite_loop_is_a_bounded_failure():
    t0 = time.perf_counter()
    out = code_exec({"code": "while True:\n    pass", "tests": ADD, "timeout_s": 0.5})
    assert time.perf_counter() - t0 < 4.0  # 2 tests x 0.5 s plus start-up, never forever
    assert out["reward"] == 0.0 and out["timeout"] == 1.0


def test_huge_allocation_is_a_bounded_failure():
    out = code_exec({"code": "x = bytearray(8 * 1024 ** 3)\nprint(3)", "tests": ADD[:1],
                     "memory_mb": 128})
    assert out["reward"] == 0.0 and out["memory_error"] == 1.0
    grow = code_exec({"code": "xs = []\nwhile True:\n    xs.append(' ' * 10 ** 6)",
                      "tests": ADD[:1], "memory_mb": 128, "timeout_s": 5})
    assert grow["reward"] == 0.0 and grow["memory_error"] == 1.0 and grow["run_s"] < 4.0


def test_writes_outside_the_temp_dir_fail_and_leave_nothing(tmp_path):
    targets = [Path("/tmp") / f"rollart-evil-{uuid.uuid4().hex}",
               Path(__file__).resolve().parents[2] / f"evil-{uuid.uuid4().hex}",
               tmp_path / "evil"]
    for target in targets:
        for code in (f"open({str(target)!r}, 'w').write('pwned')\nprint(3)",
                     f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nprint(3)"):
            out = code_exec({"code": code, "tests": ADD[:1]})
            assert out["reward"] == 0.0 and out["sandbox_violation"] == 1.0, (target, out)
            assert not target.exists()
    # Its own temp dir is writable.
    own = code_exec({"code": "open('scratch.txt', 'w').write('3')\n"
                             "print(open('scratch.txt').read())", "tests": ADD[:1]})
    assert own["reward"] == 1.0


def test_no_access_to_the_caller(monkeypatch):
    monkeypatch.setenv("ROLLART_TEST_SECRET", "s3cr3t")
    env = code_exec({"code": "import os\nprint(os.environ.get('ROLLART_TEST_SECRET'))",
                     "tests": [{"input": "", "output": "None"}]})
    assert env["reward"] == 1.0  # the caller's environment (AWS keys, ...) is not inherited
    proc = code_exec({"code": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                      "tests": [{"input": "", "output": ""}]})
    assert proc["reward"] == 0.0 and proc["sandbox_violation"] == 1.0
    kill = code_exec({"code": "import os\nos.kill(os.getppid(), 9)",
                      "tests": [{"input": "", "output": ""}]})
    assert kill["reward"] == 0.0 and kill["sandbox_violation"] == 1.0  # and we are still here
    spam = code_exec({"code": "while True:\n    print('x' * 100000)", "tests": ADD[:1],
                      "timeout_s": 5})
    assert spam["reward"] == 0.0 and spam["run_s"] < 4.0  # output capped by RLIMIT_FSIZE
    assert os.getpid() > 0


def test_model_reward_builtin_is_cached_and_deterministic():
    first = reward_model({"response": "<answer>Left</answer>", "seed": 123})
    again = reward_model({"response": "<answer>Left</answer>", "seed": 123})
    other = reward_model({"response": "something else entirely", "seed": 123})
    assert 0.0 < first["reward"] < 1.0
    assert first["cold_start"] == 1.0 and again["cold_start"] == 0.0 and again["load_s"] == 0.0
    assert again["reward"] == first["reward"] and other["reward"] != first["reward"]


def test_model_reward_from_local_dir(tmp_path, monkeypatch):
    import torch

    from rollart.rewards.model_reward import byte_ids

    model = tiny_classifier(seed=7)
    model.save_pretrained(tmp_path / "rm")
    monkeypatch.setenv("ROLLART_REWARD_MODEL_DIR", str(tmp_path / "rm"))
    out = reward_model({"text": "hello"})
    with torch.inference_mode():
        want = torch.sigmoid(model(input_ids=torch.tensor([byte_ids("hello")])).logits[0, 0])
    assert out["reward"] == pytest.approx(float(want), abs=1e-6)
    assert out["cold_start"] == 1.0 and reward_model({"text": "x"})["cold_start"] == 0.0
