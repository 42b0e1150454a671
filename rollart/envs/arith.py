"""Verifiable arithmetic: a single-turn text env whose answers are checked by math verification.

`reset(seed)` generates one problem from the seed (same seed, same problem), e.g.
"Compute 37 + 58." The model answers in one turn; the episode ends after it. The answer is
scored by the `math` reward handler (rollart/rewards/math_reward.py: math-verify symbolic
equivalence, the tagged `<answer>` preferred, else the last number in the text), the same
function that is deployed to Lambda; the env calls it in-process because the reward event does
not carry the gold answer. A response without `<answer>...</answer>` pays `format_penalty`.

Difficulty through `env_kwargs` (all optional):

    min_value, max_value: operand range (default 1..50)
    ops: operators drawn per problem, from "+", "-", "*" (default ["+", "-"])
    terms: number of operands (default 2)
    allow_negative: keep results < 0 for "-" (default False: operands are swapped instead)

Decode-heavy by design: a short prompt, an answer that may reason for many tokens.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollart.config import TaskConfig
from rollart.envs.registry import register_env

OPS = ("+", "-", "*")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ArithEnv:
    """One arithmetic problem per episode; reward 1 for a verified-correct final answer."""

    def __init__(self, min_value: int = 1, max_value: int = 50, ops: list[str] | None = None,
                 terms: int = 2, allow_negative: bool = False, format_penalty: float = -0.1):
        ops = list(ops or ["+", "-"])
        if not ops or any(o not in OPS for o in ops):
            raise ValueError(f"arith env_kwargs.ops must be a non-empty subset of {OPS}")
        if terms < 2 or min_value > max_value:
            raise ValueError("arith needs terms >= 2 and min_value <= max_value")
        self.lo, self.hi, self.ops, self.terms = min_value, max_value, ops, terms
        self.allow_negative = allow_negative
        self.format_penalty = format_penalty
        self.problem, self.answer = "", 0
        self._done = True

    # -- Env protocol -------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        return ("You are a careful calculator. Solve the problem, then give the final number "
                "as <answer>N</answer>.")

    @property
    def action_names(self) -> list[str]:
        return []  # free-form answers: no action vocabulary (constrained sampling n/a)

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.problem, self.answer = self.generate(int(seed))
        self._done = False
        return f"Compute {self.problem}.", {"seed": int(seed), "answer": str(self.answer)}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self._done = True
        tagged = _TAGGED.findall(action_text)
        correct, parsed = self.verify(action_text)
        penalty = 0.0 if tagged else self.format_penalty
        task_reward = 1.0 if correct else 0.0
        info = {"action": tagged[-1].strip() if tagged else None, "format_ok": bool(tagged),
                "valid": parsed, "success": correct, "task_reward": task_reward,
                "format_penalty": penalty, "turn": 1, "answer": str(self.answer)}
        return "", task_reward + penalty, True, False, info

    def close(self) -> None:
        pass

    # -- helpers ------------------------------------------------------------------------
    def generate(self, seed: int) -> tuple[str, int]:
        """(problem text, integer answer), deterministic in `seed`."""
        rng = random.Random(seed)
        nums = [rng.randint(self.lo, self.hi) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        if not self.allow_negative and self.terms == 2 and ops[0] == "-" and nums[0] < nums[1]:
            nums = [nums[1], nums[0]]
        text = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:], strict=True))
        return text, int(eval(text, {"__builtins__": {}}))  # digits and + - * only

    def verify(self, response: str) -> tuple[bool, bool]:
        """(correct, an answer was parsed) by the `math` reward handler."""
        from rollart.rewards.math_reward import math_answer

        out = math_answer({"response": response, "answer": str(self.answer)})
        return out["reward"] > 0, bool(out["parsed"])

    def corpus_texts(self, episodes: int = 20, seed: int = 0) -> list[str]:
        """Texts for a locally trained tokenizer (tiny models): prompts and worked answers."""
        texts = [self.system_prompt]
        for s in range(seed, seed + episodes):
            problem, answer = self.generate(s)
            texts += [f"Compute {problem}.", f"{problem} = {answer}. <answer>{answer}</answer>"]
        return texts


@register_env("arith")
def build_arith(task: TaskConfig) -> ArithEnv:
    """env_id "arith" (or "arith-..."); difficulty from `env_kwargs` (see module docstring).
    Set `env_kwargs` explicitly (`{}` for the defaults): the task default is FrozenLake's."""
    known = {"min_value", "max_value", "ops", "terms", "allow_negative"}
    unknown = sorted(set(task.env_kwargs) - known)
    if unknown:
        raise ValueError(f"arith env_kwargs {unknown} unknown; known: {sorted(known)}")
    return ArithEnv(**task.env_kwargs, format_penalty=task.format_penalty)
