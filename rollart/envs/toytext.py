"""Gymnasium toy-text environments (FrozenLake, CliffWalking, Taxi, ...) behind the text `Env`.

Per-family knowledge (action names, system prompt, state text, success test) lives in `FAMILIES`,
keyed by the class name of the gymnasium entry point, so every registered variant of a family
(FrozenLake8x8-v1, CliffWalkingSlippery-v1, ...) is covered. Other ids work with explicit
`action_names` and fall back to the stripped ANSI render (or `str(obs)`) as state text.

FrozenLake random maps: `env_kwargs={"random_map": True, "size": 4, "p": 0.8, ...}` generates the
map from the reset seed, so held-out seeds are held-out maps.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium.envs.registration import load_env_creator
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from rollart.envs.base import answer_format, turn_text
from rollart.envs.parsing import PARSER_MODES, ParserMode, format_score, parse_action

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RANDOM_MAP_KEYS = ("random_map", "size", "p")


def strip_ansi(text: str) -> str:
    return ANSI_ESCAPE.sub("", text)


def _frozenlake_text(env: Any, obs: Any) -> str:
    rows = [[c.decode() for c in row] for row in env.desc]
    r, c = divmod(int(obs), len(rows[0]))
    rows[r][c] = "P"
    # The explicit position saves a tiny model from locating P inside BPE-merged grid rows.
    return "\n".join("".join(row) for row in rows) + f"\nP is at row {r + 1}, column {c + 1}."


def _cliffwalking_text(env: Any, obs: Any) -> str:
    n_rows, n_cols = env.shape
    rows = [["C" if env._cliff[r, c] else "o" for c in range(n_cols)] for r in range(n_rows)]
    rows[-1][-1] = "T"
    r, c = divmod(int(obs), n_cols)
    rows[r][c] = "x"
    return "\n".join("".join(row) for row in rows)


TAXI_LOCATIONS = ("R", "G", "Y", "B")


def _taxi_text(env: Any, obs: Any) -> str:
    rows = [[c.decode() for c in row] for row in env.desc]
    taxi_row, taxi_col, passenger, destination = env.decode(int(obs))
    rows[1 + taxi_row][2 * taxi_col + 1] = "T"
    where = "in taxi" if passenger == len(TAXI_LOCATIONS) else f"at {TAXI_LOCATIONS[passenger]}"
    grid = "\n".join("".join(row) for row in rows)
    return f"{grid}\nPassenger {where}, destination {TAXI_LOCATIONS[destination]}."


@dataclass(frozen=True)
class Family:
    """What the adapter knows about one gymnasium toy-text family."""

    action_names: tuple[str, ...]
    intro: str  # first part of the system prompt; the answer format is appended
    text: Callable[[Any, Any], str]  # (unwrapped env, obs) -> state text
    success: Callable[[Any, Any, float, bool], bool]  # (unwrapped env, obs, reward, terminated)


FAMILIES: dict[str, Family] = {
    "FrozenLakeEnv": Family(
        action_names=("Left", "Down", "Right", "Up"),
        intro="You are walking on a frozen lake. Reach the goal G without falling into a hole H. "
        "P is you, F is frozen ice.",
        text=_frozenlake_text,
        success=lambda env, obs, reward, terminated: terminated and reward > 0,
    ),
    "CliffWalkingEnv": Family(
        action_names=("Up", "Right", "Down", "Left"),
        intro="You are walking along a cliff. Reach the goal T without stepping onto the cliff C. "
        "x is you, o is safe ground.",
        text=_cliffwalking_text,
        success=lambda env, obs, reward, terminated: terminated and int(obs) == env.nS - 1,
    ),
    "TaxiEnv": Family(
        action_names=("South", "North", "East", "West", "Pickup", "Dropoff"),
        intro="You drive a taxi T. Pick up the passenger and drop them off at the destination. "
        "R, G, Y, B are stops and | is a wall.",
        text=_taxi_text,
        success=lambda env, obs, reward, terminated: terminated and reward >= 20,
    ),
}


def _family_key(env_id: str) -> tuple[str, set[str]]:
    """(entry-point class name, supported render modes) of a gymnasium id; ValueError if unknown."""
    try:
        spec = gymnasium.spec(env_id)
    except gymnasium.error.Error as exc:
        raise ValueError(f"gymnasium cannot make {env_id!r}: {exc}") from exc
    creator = spec.entry_point
    if isinstance(creator, str):
        key = creator.rsplit(":", 1)[-1]
        try:
            creator = load_env_creator(creator)
        except Exception:  # an entry point that cannot be imported fails later, at make()
            creator = None
    else:
        key = getattr(creator, "__name__", str(creator))
    modes = set(getattr(creator, "metadata", {}).get("render_modes", []))
    return key, modes


class ToyTextEnv:
    """A gymnasium toy-text env as a multi-turn text `Env` (see rollart.envs.base)."""

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        max_turns: int = 8,
        format_penalty: float = -0.01,
        parser: ParserMode = "lenient",
        action_names: list[str] | None = None,
        format_credit: str = "graded",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if parser not in PARSER_MODES:
            raise ValueError(f"parser must be one of {PARSER_MODES}, got {parser!r}")
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.max_turns = max_turns
        self.format_penalty = float(format_penalty)
        self.parser: ParserMode = parser
        if format_credit not in ("graded", "action"):
            raise ValueError(f"format_credit must be 'graded' or 'action', got {format_credit!r}")
        self.format_credit = format_credit
        key, self._render_modes = _family_key(env_id)
        self.family: Family | None = FAMILIES.get(key)
        self._random_map = bool(self.env_kwargs.get("random_map", False))
        if self._random_map and key != "FrozenLakeEnv":
            raise ValueError(
                f"env_kwargs['random_map'] is only supported for FrozenLake, not {key}"
            )
        if action_names is None:
            if self.family is None:
                raise ValueError(
                    f"no default action names for {env_id!r} (known families: "
                    f"{', '.join(FAMILIES)}); pass action_names, in the env's action-id order"
                )
            action_names = list(self.family.action_names)
        self._names = _check_names(action_names)
        self._inner: gymnasium.Env | None = None
        self._obs: Any = None
        self._turn = 0
        self._done = True
        if not self._random_map:
            self._inner = self._make(self.env_kwargs)
            _check_action_space(self._inner, self._names, env_id)

    # -- Env contract -------------------------------------------------------------------------

    @property
    def action_names(self) -> list[str]:
        return list(self._names)

    @property
    def system_prompt(self) -> str:
        intro = self.family.intro if self.family else f"You are playing {self.env_id}."
        return f"{intro} Answer with one move: {answer_format(self._names)}."

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        seed = int(seed)
        if self._random_map:
            if self._inner is not None:
                self._inner.close()
            kwargs = {k: v for k, v in self.env_kwargs.items() if k not in RANDOM_MAP_KEYS}
            kwargs.pop("map_name", None)
            size, p = int(self.env_kwargs.get("size", 4)), float(self.env_kwargs.get("p", 0.8))
            kwargs["desc"] = generate_random_map(size=size, p=p, seed=seed)
            self._inner = self._make(kwargs)
            _check_action_space(self._inner, self._names, self.env_id)
        assert self._inner is not None
        self._obs, _ = self._inner.reset(seed=seed)
        self._turn = 0
        self._done = False
        return self._text(), {"seed": seed, "max_turns": self.max_turns}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._inner is None or self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        name, format_ok = parse_action(action_text, self._names, self.parser)
        self._turn += 1
        # Graded format credit: each piece of the format present reduces the penalty, so a model
        # from random init gets a signal long before it emits the full tag format.
        if format_ok:
            penalty = 0.0
        elif self.format_credit == "action":  # only a turn without any action is penalised
            penalty = self.format_penalty if name is None else 0.0
        else:
            penalty = self.format_penalty * (1.0 - format_score(action_text, self._names))
        task_reward, terminated, inner_truncated, success = 0.0, False, False, False
        if name is not None:
            obs, reward, terminated, inner_truncated, _ = self._inner.step(self._names.index(name))
            self._obs, task_reward, terminated = obs, float(reward), bool(terminated)
            if self.family is not None:
                unwrapped = self._inner.unwrapped
                success = bool(self.family.success(unwrapped, obs, task_reward, terminated))
            else:
                success = terminated and task_reward > 0
        truncated = not terminated and (bool(inner_truncated) or self._turn >= self.max_turns)
        self._done = terminated or truncated
        info = {
            "action": name,
            "format_ok": format_ok,
            "valid": name is not None,
            "success": success,
            "task_reward": task_reward,
            "format_penalty": penalty,
            "turn": self._turn,
        }
        return self._text(), task_reward + penalty, terminated, truncated, info

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None
        self._done = True

    # -- helpers ------------------------------------------------------------------------------

    def state_text(self) -> str:
        """The current state without the turn header (after reset)."""
        if self._inner is None:
            raise RuntimeError("state_text() called before reset()")
        if self.family is not None:
            return self.family.text(self._inner.unwrapped, self._obs)
        if "ansi" in self._render_modes:
            rendered = self._inner.render()
            if isinstance(rendered, str) and rendered.strip():
                return strip_ansi(rendered).strip("\n")
        return str(self._obs)

    def corpus_texts(self, episodes: int = 20, seed: int = 0) -> list[str]:
        """Texts this env shows or expects (prompt, observations, answers), for a tokenizer.

        Plays `episodes` random-action episodes on seeds seed, seed+1, ... in a fresh copy of
        this env, so the state of this instance is left alone.
        """
        texts = [self.system_prompt] + [f"<answer>{name}</answer>" for name in self._names]
        rng = random.Random(seed)
        env = ToyTextEnv(
            self.env_id, self.env_kwargs, self.max_turns, self.format_penalty, "strict", self._names
        )
        try:
            for episode in range(episodes):
                obs, _ = env.reset(seed + episode)
                texts.append(obs)
                done = False
                while not done:
                    answer = f"<answer>{rng.choice(self._names)}</answer>"
                    obs, _, terminated, truncated, _ = env.step(answer)
                    texts.append(obs)
                    done = terminated or truncated
        finally:
            env.close()
        return texts

    def _text(self) -> str:
        return turn_text(self._turn + 1, self.state_text(), self.max_turns - self._turn)

    def _make(self, kwargs: dict[str, Any]) -> gymnasium.Env:
        render_mode = "ansi" if "ansi" in self._render_modes else None
        return gymnasium.make(
            self.env_id, render_mode=render_mode, disable_env_checker=True, **kwargs
        )


def _check_names(action_names: list[str]) -> list[str]:
    names = [str(name) for name in action_names]
    folded = [name.casefold() for name in names]
    if not names or any(not name.strip() for name in names) or len(set(folded)) != len(names):
        raise ValueError(f"action_names must be non-empty and unique (ignoring case): {names}")
    return names


def _check_action_space(env: gymnasium.Env, names: list[str], env_id: str) -> None:
    n = getattr(env.action_space, "n", None)
    if n is not None and int(n) != len(names):
        raise ValueError(f"{env_id} has {int(n)} actions but {len(names)} action_names: {names}")
