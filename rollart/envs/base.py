"""The environment contract: text in, text out, never a crash on a malformed action.

An episode is `reset(seed)` followed by `step(action_text)` calls until `terminated` or
`truncated`. Each observation is the next user message of the conversation, rendered by
`turn_text`: "Turn 3:\\n<state>\\n5 moves remaining." (the first observation is turn 1 with
`max_turns` actions left).

`step` returns `reward = task_reward + format_penalty` for that turn, and an `info` dict that holds
at least the keys of `StepInfo`.
"""

from __future__ import annotations

from typing import Any, Protocol, TypedDict, runtime_checkable


class StepInfo(TypedDict):
    """Keys every `Env.step` info dict carries (adapters may add more)."""

    action: str | None  # canonical action name parsed from the text, None if none was found
    format_ok: bool  # the strict `<answer>X</answer>` format was followed
    valid: bool  # an action was found and executed (False: state unchanged)
    success: bool  # the task was solved on this step (e.g. FrozenLake goal reached)
    task_reward: float  # reward from the task itself
    format_penalty: float  # 0.0, or the configured penalty when format_ok is False
    turn: int  # number of step calls so far in this episode, this one included


@runtime_checkable
class Env(Protocol):
    """A stateful, text-based, multi-turn environment (runs on CPU-class workers only)."""

    @property
    def system_prompt(self) -> str:
        """Task instructions, including the answer format and the legal action names."""
        ...

    @property
    def action_names(self) -> list[str]:
        """Canonical action names, in the order of the underlying action ids."""
        ...

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Start an episode; deterministic given `seed`. Returns (obs_text, info)."""
        ...

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the model's raw text. Returns (obs_text, reward, terminated, truncated, info)."""
        ...

    def close(self) -> None:
        """Release resources; the env is not used afterwards."""
        ...


def turn_text(turn: int, body: str, actions_left: int) -> str:
    """The per-turn user message shared by all adapters (kept short for tiny models)."""
    # No action name may appear here ("actions left." once became a token that the lenient
    # parser read as the action Left, and the policy learned to copy it).
    unit = "move" if actions_left == 1 else "moves"
    return f"Turn {turn}:\n{body}\n{actions_left} {unit} remaining."


def answer_format(action_names: list[str]) -> str:
    """'<answer>A</answer>, <answer>B</answer> or <answer>C</answer>' for a system prompt."""
    tags = [f"<answer>{name}</answer>" for name in action_names]
    if len(tags) == 1:
        return tags[0]
    return ", ".join(tags[:-1]) + " or " + tags[-1]
