"""Task profiles measured online: what one turn of each task costs, smoothed.

The router needs, before a request runs, how many tokens it will decode; the cost model also wants
the new prompt tokens per turn (after prefix reuse) and the env latency that separates turns. All
three are task properties that drift as the policy learns (answers get longer or shorter), so they
are exponential moving averages updated from every finished turn, not config constants.

Pure: no clocks, no I/O. The caller measures and reports; `metrics()` gives the log keys
`rollout/profile/{task}/...`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ema:
    """Bias-free EMA: the first sample sets the value (no pull towards an arbitrary zero)."""

    alpha: float
    value: float = 0.0
    count: int = 0

    def update(self, x: float) -> float:
        self.value = float(x) if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1
        return self.value


@dataclass
class TaskProfile:
    new_prompt_tokens: Ema
    decode_tokens: Ema
    env_step_s: Ema

    @property
    def turns(self) -> int:
        return self.decode_tokens.count


class TaskProfiles:
    """Per-task EMAs of new prompt tokens per turn, decode tokens per turn and env step latency.

    `alpha` weighs the newest observation (0.1-0.3 follows drift within tens of turns while one
    long answer does not swing routing). Unseen tasks answer with the given prior (e.g. the
    task's `max_new_tokens`), so the first turns are routed on the worst case, not on zero.
    """

    def __init__(self, alpha: float = 0.2, prior_decode_tokens: float = 0.0,
                 prior_new_prompt_tokens: float = 0.0):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.prior_decode_tokens = prior_decode_tokens
        self.prior_new_prompt_tokens = prior_new_prompt_tokens
        self._tasks: dict[str, TaskProfile] = {}

    def _get(self, task: str) -> TaskProfile:
        p = self._tasks.get(task)
        if p is None:
            p = self._tasks[task] = TaskProfile(Ema(self.alpha), Ema(self.alpha), Ema(self.alpha))
        return p

    def observe_turn(self, task: str, new_prompt_tokens: int, decode_tokens: int) -> None:
        """One finished generation turn: prompt tokens that had to be prefilled (not reused from
        the prefix cache) and tokens decoded."""
        p = self._get(task)
        p.new_prompt_tokens.update(new_prompt_tokens)
        p.decode_tokens.update(decode_tokens)

    def observe_env_step(self, task: str, seconds: float) -> None:
        self._get(task).env_step_s.update(seconds)

    def expected_decode_tokens(self, task: str, prior: float | None = None) -> float:
        p = self._tasks.get(task)
        if p is None or p.decode_tokens.count == 0:
            return self.prior_decode_tokens if prior is None else prior
        return p.decode_tokens.value

    def expected_new_prompt_tokens(self, task: str, prior: float | None = None) -> float:
        p = self._tasks.get(task)
        if p is None or p.new_prompt_tokens.count == 0:
            return self.prior_new_prompt_tokens if prior is None else prior
        return p.new_prompt_tokens.value

    def tasks(self) -> list[str]:
        return sorted(self._tasks)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for task in self.tasks():
            p = self._tasks[task]
            key = f"rollout/profile/{task}"
            out[f"{key}/new_prompt_tokens"] = p.new_prompt_tokens.value
            out[f"{key}/decode_tokens"] = p.decode_tokens.value
            out[f"{key}/env_step_s"] = p.env_step_s.value
            out[f"{key}/turns"] = float(p.turns)
            # > 1: prefill-heavy (long observations, short actions); < 1: decode-heavy.
            out[f"{key}/prefill_decode_ratio"] = (
                p.new_prompt_tokens.value / p.decode_tokens.value if p.decode_tokens.value else 0.0)
        return out
