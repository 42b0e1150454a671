"""Parse an action name out of a model's text. Pure functions; never raise on any string.

Strict format: the whole response is exactly one `<answer>X</answer>`, optionally preceded by one
`<think>...</think>` block, with only whitespace elsewhere; X (stripped) must equal an action name,
compared case-insensitively. Lenient mode falls back to the first action name that appears as a
whole word anywhere in the text, and reports `format_ok=False` for it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

ParserMode = Literal["strict", "lenient"]
PARSER_MODES: tuple[str, ...] = ("strict", "lenient")

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def parse_action(
    text: str, action_names: list[str], mode: ParserMode = "lenient"
) -> tuple[str | None, bool]:
    """Return (canonical action name or None, format_ok)."""
    if mode not in PARSER_MODES:
        raise ValueError(f"parser mode must be one of {PARSER_MODES}, got {mode!r}")
    if not isinstance(text, str) or not action_names:
        return None, False
    strict = parse_strict(text, action_names)
    if strict is not None:
        return strict, True
    if mode == "lenient":
        return first_action_word(text, action_names), False
    return None, False


def parse_strict(text: str, action_names: list[str]) -> str | None:
    """The action named in a strictly formatted response, else None."""
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return None
    rest = text.strip()
    if rest.startswith(THINK_OPEN):
        end = rest.find(THINK_CLOSE)
        if end < 0:
            return None
        rest = rest[end + len(THINK_CLOSE) :].lstrip()
    if not (rest.startswith(ANSWER_OPEN) and rest.endswith(ANSWER_CLOSE)):
        return None
    inner = rest[len(ANSWER_OPEN) : -len(ANSWER_CLOSE)].strip()
    return _canonical(action_names).get(inner.casefold())


def format_score(text: str, action_names: list[str]) -> float:
    """Graded format credit in [0, 1]: 1 for the strict format, else partial credit for each
    piece present (an action word 0.4, `<answer>` 0.25, `</answer>` 0.25; at most 0.9).

    A model trained from random init almost never emits the full format by chance; partial
    credit per piece gives the policy gradient a slope to climb toward it.
    """
    if not isinstance(text, str) or not action_names:
        return 0.0
    if parse_strict(text, action_names) is not None:
        return 1.0
    score = 0.4 if first_action_word(text, action_names) is not None else 0.0
    score += 0.25 if ANSWER_OPEN in text else 0.0
    score += 0.25 if ANSWER_CLOSE in text else 0.0
    return score


def first_action_word(text: str, action_names: list[str]) -> str | None:
    """The first action name found as a whole word (case-insensitive), else None."""
    match = _word_pattern(tuple(action_names)).search(text)
    if match is None:
        return None
    return _canonical(action_names).get(match.group(0).casefold())


def _canonical(action_names: list[str]) -> dict[str, str]:
    return {name.casefold(): name for name in action_names}


@lru_cache(maxsize=64)
def _word_pattern(action_names: tuple[str, ...]) -> re.Pattern[str]:
    # Longest names first so that one name that prefixes another cannot shadow it; lookarounds
    # instead of \b so names that start or end with a non-word character still match.
    names = sorted(action_names, key=len, reverse=True)
    alternatives = "|".join(re.escape(name) for name in names)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)


def check_turn_settings(max_turns: int, parser: str, format_credit: str) -> None:
    """The settings every multi-turn text env takes from its task (one message per mistake)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if parser not in PARSER_MODES:
        raise ValueError(f"parser must be one of {PARSER_MODES}, got {parser!r}")
    if format_credit not in ("graded", "action"):
        raise ValueError(f"format_credit must be 'graded' or 'action', got {format_credit!r}")
