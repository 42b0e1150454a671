"""Data that crosses process boundaries: generation requests, completions, trajectories.

Everything here is a plain dataclass of Python scalars and lists so it pickles cheaply between Dask
workers and maps one-to-one onto the Arrow schema used for trajectory shards.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings; the stop string is kept
    # Constrained sampling: only these token ids may be generated (None = whole vocabulary).
    # Log-probs are then taken under the restricted (renormalised) distribution.
    allowed_token_ids: list[int] | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]  # full context (conversation so far), no padding
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]  # generated tokens only
    logprobs: list[float]  # behaviour log-prob of each generated token, len == len(token_ids)
    text: str  # decoded generated tokens (special tokens kept)
    finish_reason: str  # "stop" (stop string), "eos", or "length"
    weight_version: int  # policy version that produced every token of this completion
    prompt_tokens: int = 0
    generate_s: float = 0.0


@dataclass
class Turn:
    index: int
    observation: str
    response: str
    action: str | None  # parsed action name, None when the response had no valid action
    format_ok: bool  # strict <answer>...</answer> format was followed
    env_reward: float
    prompt_tokens: int  # new (non-model) tokens appended before this turn's generation
    completion_tokens: int
    weight_version: int
    generate_s: float
    env_s: float


@dataclass
class Trajectory:
    sample_id: str  # unique across the run: "{task}/{seed}/{member}@{iteration}"
    task: str  # task name from config (one env kind may appear under several task names)
    env_id: str
    group_id: str
    seed: int
    iteration: int
    token_ids: list[int]  # whole conversation: system, user, assistant turns
    loss_mask: list[int]  # 1 only on model-generated tokens
    behaviour_logprobs: list[float]  # per token; 0.0 where loss_mask == 0
    token_versions: list[int]  # policy version per token; -1 where loss_mask == 0
    allowed_token_ids: list[int] | None = None  # sampling restriction the log-probs are under
    turns: list[Turn] = field(default_factory=list)
    env_return: float = 0.0  # sum of env rewards (task reward + format penalties)
    task_return: float = 0.0  # sum of task rewards alone
    format_penalty: float = 0.0  # sum of per-turn format penalties (<= 0)
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    format_errors: int = 0
    error: str | None = None  # set when the episode was cut short by an env failure
    reward: float | None = None  # scalar reward after scoring
    reward_details: dict[str, float] = field(default_factory=dict)
    advantage: float | None = None
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, generate_s, env_s, reward_s

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def start_version(self) -> int:
        return self.turns[0].weight_version if self.turns else -1

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["turns"] = [asdict(t) for t in self.turns]
        row["reward_details"] = [{"key": k, "value": v} for k, v in self.reward_details.items()]
        row["timings"] = [{"key": k, "value": v} for k, v in self.timings.items()]
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Trajectory:
        row = dict(row)
        row["turns"] = [Turn(**t) for t in row["turns"]]
        row["reward_details"] = {kv["key"]: kv["value"] for kv in row["reward_details"]}
        row["timings"] = {kv["key"]: kv["value"] for kv in row["timings"]}
        return cls(**row)


_KV = pa.list_(pa.struct([("key", pa.string()), ("value", pa.float64())]))

TURN_SCHEMA = pa.struct(
    [
        ("index", pa.int32()),
        ("observation", pa.string()),
        ("response", pa.string()),
        ("action", pa.string()),
        ("format_ok", pa.bool_()),
        ("env_reward", pa.float64()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("weight_version", pa.int64()),
        ("generate_s", pa.float64()),
        ("env_s", pa.float64()),
    ]
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("task", pa.string()),
        ("env_id", pa.string()),
        ("group_id", pa.string()),
        ("seed", pa.int64()),
        ("iteration", pa.int64()),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("token_versions", pa.list_(pa.int64())),
        ("allowed_token_ids", pa.list_(pa.int32())),
        ("turns", pa.list_(TURN_SCHEMA)),
        ("env_return", pa.float64()),
        ("task_return", pa.float64()),
        ("format_penalty", pa.float64()),
        ("success", pa.bool_()),
        ("terminated", pa.bool_()),
        ("truncated", pa.bool_()),
        ("format_errors", pa.int32()),
        ("error", pa.string()),
        ("reward", pa.float64()),
        ("reward_details", _KV),
        ("advantage", pa.float64()),
        ("timings", _KV),
    ]
)


def trajectories_to_table(trajs: list[Trajectory]) -> pa.Table:
    return pa.Table.from_pylist([t.to_row() for t in trajs], schema=TRAJECTORY_SCHEMA)


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    return [Trajectory.from_row(r) for r in table.to_pylist()]
