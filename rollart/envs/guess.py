"""Guess the number: a multi-turn env with "higher"/"lower" feedback after every guess.

`reset(seed)` draws a secret integer in `low..high` from the seed (same seed, same secret). Each
turn the model answers `<answer>K</answer>`; a wrong guess is answered with whether the secret is
higher or lower, and (with `show_range`) the interval still possible given every answer so far.
Reward 1 for the correct guess within `max_turns`, else 0; the episode ends at once on it.

Why this task: it is verifiable, every turn carries feedback the next action should use, and its
difficulty is a dial (range size vs turns: binary search needs ceil(log2(n)) guesses), so a
135M-parameter base model lands in the 5-60 % band where GRPO has a gradient to follow.

Parsing (pure, never raises; `parse_guess`):
- strict (`format_ok`): the whole response is one `<answer>K</answer>` (an optional leading
  `<think>...</think>`, whitespace and a trailing `<|im_end|>` allowed), K an integer.
- lenient (parser "lenient", the default): else the *first* `<answer>...</answer>` tag whose
  content is an integer (whitespace, a sign, thousands commas or a trailing period inside the
  tag and any text around it are tolerated), else the first integer anywhere in the text (as
  the toy-text adapters fall back to the first action word). First, because the engine's stop
  string (`</answer>`) ends a turn at the first closing tag, so a run never sees a second one,
  and the base model's first number is its guess ("The answer is 2. ...").
- parser "strict" executes only the strict format.
- anything else (no integer at all) is a malformed action: the full format penalty, the turn is
  used up, and the observation says what format is expected.

Format penalty per turn: 0 for the strict format; a lenient guess pays half of it under
`format_credit: graded` (nothing under `action`); a malformed action pays all of it.

Observations carry no turn counter (unlike `base.turn_text`): SmolLM2-135M copied
"5 moves remaining" as its guess, counting down 5, 4, 3, ... (measured); the system prompt says
how many guesses there are instead.

`env_kwargs` (all optional): `low` (1), `high` (16), `show_range` (True). Base rate of
SmolLM2-135M-Instruct with these and `max_turns: 6` (T=0.7, 32 episodes,
results/agentic_base_rate.json): 19 % unconstrained (its guesses mostly count down or up one at a
time), 56 % with `constrained: true`.
Constrained decoding works as is: the answer language is finite, so `action_names` lists
"low".."high" and `tasks[].constrained: true` restricts sampling to those `<answer>` turns.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollart.config import TaskConfig
from rollart.envs.parsing import ANSWER_CLOSE, ANSWER_OPEN, ParserMode, check_turn_settings
from rollart.envs.registry import register_env
from rollart.envs.toolcall import strip_end_tokens

MAX_RANGE = 10_000  # `action_names` lists every number: keep the answer language small
_INT = re.compile(r"\s*([+-]?\d{1,3}(?:,\d{3})+|[+-]?\d{1,12})\s*\.?\s*")
_BARE = re.compile(r"(?<![\w.,])([+-]?\d{1,3}(?:,\d{3})+|[+-]?\d{1,12})(?![\w]|[.,]\d)")
_THINK = re.compile(r"\s*<think>.*?</think>", re.DOTALL)


def parse_guess(text: str, mode: ParserMode = "lenient") -> tuple[int | None, bool]:
    """(guessed integer or None, strict format followed). Never raises on any string."""
    if not isinstance(text, str):
        return None, False
    text = strip_end_tokens(text)
    tags = answer_tags(text)
    if len(tags) == 1 and text.count(ANSWER_OPEN) == 1:
        (start, end, content), think = tags[0], _THINK.match(text)
        value, before = read_integer(content), text[think.end() if think else 0:start]
        if value is not None and not before.strip() and not text[end:].strip():
            return value, True
    if mode != "lenient":
        return None, False
    for _, _, content in tags:
        value = read_integer(content)
        if value is not None:
            return value, False
    bare = _BARE.search(text)
    return (int(bare.group(1).replace(",", "")), False) if bare else (None, False)


def answer_tags(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of each `<answer>...</answer>`, left to right, not overlapping
    (what a lazy regex finds), in linear time: a lazy regex rescans the rest of the text from
    every unclosed `<answer>`, quadratic on a response that repeats the open tag."""
    tags, pos = [], 0
    while (start := text.find(ANSWER_OPEN, pos)) >= 0:
        close = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if close < 0:
            break
        pos = close + len(ANSWER_CLOSE)
        tags.append((start, pos, text[start + len(ANSWER_OPEN):close]))
    return tags


def read_integer(content: str) -> int | None:
    """The integer that `content` (an answer tag's inside) holds, tolerating whitespace, a sign,
    thousands commas and a trailing period; None for anything else."""
    match = _INT.fullmatch(content)
    return int(match.group(1).replace(",", "")) if match else None


class GuessEnv:
    """Find a secret integer in low..high from higher/lower feedback (see module docstring)."""

    def __init__(self, low: int = 1, high: int = 16, show_range: bool = True, max_turns: int = 6,
                 format_penalty: float = -0.1, parser: ParserMode = "lenient",
                 format_credit: str = "graded") -> None:
        if low > high or high - low + 1 > MAX_RANGE:
            raise ValueError(f"guess needs low <= high and at most {MAX_RANGE} numbers, "
                             f"got {low}..{high}")
        check_turn_settings(max_turns, parser, format_credit)
        self.low, self.high, self.show_range = int(low), int(high), bool(show_range)
        self.max_turns, self.format_penalty = max_turns, float(format_penalty)
        self.parser: ParserMode = parser
        self.format_credit = format_credit
        self.secret = self.low
        self._lo, self._hi = self.low, self.high  # interval still possible
        self._turn, self._done = 0, True

    # -- Env protocol -------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        middle = (self.low + self.high) // 2
        return (f"We play a guessing game. I am thinking of a secret whole number from {self.low} "
                f"to {self.high}. You have {self.max_turns} guesses. After each wrong guess I tell "
                "you whether the secret number is higher or lower. Reply with only your guess, "
                f"written as <answer>N</answer>, for example <answer>{middle}</answer>.")

    @property
    def action_names(self) -> list[str]:
        return [str(k) for k in range(self.low, self.high + 1)]

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        seed = int(seed)
        self.secret = random.Random(seed).randint(self.low, self.high)
        self._lo, self._hi = self.low, self.high
        self._turn, self._done = 0, False
        obs = f"Guess the secret number from {self.low} to {self.high}."
        return obs, {"seed": seed, "max_turns": self.max_turns}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        guess, strict = parse_guess(action_text, self.parser)
        self._turn += 1
        if strict:
            penalty = 0.0
        elif guess is None:
            penalty = self.format_penalty
        else:
            penalty = 0.5 * self.format_penalty if self.format_credit == "graded" else 0.0
        success = guess == self.secret
        terminated = success
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        task_reward = 1.0 if success else 0.0
        info = {"action": None if guess is None else str(guess), "format_ok": strict,
                "valid": guess is not None, "success": success, "task_reward": task_reward,
                "format_penalty": penalty, "turn": self._turn, "secret": self.secret}
        obs = "" if self._done else self._feedback(guess)
        return obs, task_reward + penalty, terminated, truncated, info

    def close(self) -> None:
        self._done = True

    # -- helpers ------------------------------------------------------------------------
    def _middle(self) -> int:
        """The binary-search guess in the interval still possible (the format examples use it:
        a model that copies the example then plays a sensible move)."""
        return (self._lo + self._hi) // 2

    def _feedback(self, guess: int | None) -> str:
        """The answer to a wrong or malformed guess (updates the possible interval)."""
        if guess is None:
            return ("I could not read a guess. Reply with only a whole number inside answer "
                    f"tags, for example <answer>{self._middle()}</answer>.")
        if guess < self.secret:
            self._lo = max(self._lo, guess + 1)
            text = f"{guess} is too low. The secret number is higher"
        else:
            self._hi = min(self._hi, guess - 1)
            text = f"{guess} is too high. The secret number is lower"
        if self.show_range:
            return f"{text}, from {self._lo} to {self._hi}."
        return f"{text} than {guess}."

    def corpus_texts(self, episodes: int = 20, seed: int = 0) -> list[str]:
        """Texts for a locally trained tokenizer (tiny models): prompt, observations, answers."""
        texts = [self.system_prompt] + [f"<answer>{k}</answer>" for k in self.action_names]
        env = GuessEnv(self.low, self.high, self.show_range, self.max_turns)
        for s in range(seed, seed + episodes):
            obs, _ = env.reset(s)
            texts.append(obs)
            rng, done = random.Random(s), False
            while not done:
                obs, _, terminated, truncated, _ = env.step(
                    f"<answer>{rng.randint(self.low, self.high)}</answer>")
                texts.append(obs)
                done = terminated or truncated
        return texts


@register_env("guess")
def build_guess(task: TaskConfig) -> GuessEnv:
    """env_id "guess" (or "guess-..."); range via `env_kwargs` (see module docstring). Set
    `env_kwargs` explicitly (`{}` for the defaults): the task default is FrozenLake's."""
    known = {"low", "high", "show_range"}
    unknown = sorted(set(task.env_kwargs) - known)
    if unknown:
        raise ValueError(f"guess env_kwargs {unknown} unknown; known: {sorted(known)}")
    return GuessEnv(**task.env_kwargs, max_turns=task.max_turns,
                    format_penalty=task.format_penalty, parser=task.parser,
                    format_credit=task.format_credit)
