"""Math answer verification with `math-verify` (symbolic equivalence, not string match).

`math_verify` pulls in sympy (~0.5 s to import), so it is imported on first use: a worker that
never scores math never pays for it, and a warm Lambda worker pays once.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from rollart.rewards.events import response_of

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _as_math(text: str) -> str:
    """A bare answer ("2(x+1)") as LaTeX math, so math-verify reads the whole expression
    instead of picking the last number out of it."""
    return text if "$" in text or "\\boxed" in text or not text else f"${text}$"


def _timeout_s(event: dict[str, Any]) -> int | None:
    # math-verify enforces its timeout with signal.alarm, which only works in the main thread
    # (true inside a Lambda worker); in a thread pool the function timeout is the guard instead.
    if threading.current_thread() is not threading.main_thread():
        return None
    return int(event.get("timeout_s", 5))


def math_answer(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """event: {"response" | "final_response": str (may use \\boxed{} or <answer></answer>),
    "answer" | "ground_truth": str (gold answer, LaTeX or plain), "timeout_s": int = 5}

    reward 1.0 when the response's final answer is equivalent to the gold answer, else 0.0;
    `parsed` says whether any answer could be extracted from the response at all.
    """
    from math_verify import parse, verify

    gold_text = str(event.get("answer", event.get("ground_truth", "")))
    text = response_of(event)
    tagged = _ANSWER_TAG.findall(text)
    if tagged:  # prefer the tagged answer, read as one expression, over anything else
        text = _as_math(tagged[-1].strip())
    timeout = _timeout_s(event)
    gold = parse(_as_math(gold_text), parsing_timeout=timeout)
    pred = parse(text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math reward: could not parse the gold answer {gold_text!r}")
    ok = bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))
    return {"reward": float(ok), "correct": float(ok), "parsed": float(bool(pred))}
