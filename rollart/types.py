"""Data that crosses process boundaries: generation requests, completions, trajectories.

Everything here is a plain dataclass of Python scalars and lists so it pickles cheaply between Dask
workers and maps one-to-one onto the Arrow schema used for trajectory shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from rollart.arrow_schema import Float32, Int8, Int32, arrow_schema, arrow_type


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings; the stop string is kept
    # Constrained sampling: only these token ids may be generated (None = whole vocabulary).
    # Log-probs are then taken under the restricted (renormalised) distribution.
    allowed_token_ids: list[int] | None = None
    # Answer grammar (HF engine): the complete completions a turn may spell; sampling walks
    # their prefix tree (rollart.answer_trie), inside the bag above. None = bag only.
    allowed_sequences: list[list[int]] | None = None
    # Token grammar (HF engine; rollart.action_grammar.dump_grammar): a turn must spell a word
    # of it, walked per token inside the bag above; for turn languages too large to list as
    # sequences (tool calls with free arguments). Takes precedence over allowed_sequences.
    grammar: str | None = None


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
    index: Int32
    observation: str
    response: str
    action: str | None  # parsed action name, None when the response had no valid action
    format_ok: bool  # strict <answer>...</answer> format was followed
    env_reward: float
    prompt_tokens: Int32  # new (non-model) tokens appended before this turn's generation
    completion_tokens: Int32
    weight_version: int
    generate_s: float
    env_s: float


@dataclass
class Trajectory:
    sample_id: str  # unique in the run: "{task}/i{iteration}/g{group}/m{member}" (rollout/ids)
    task: str  # task name from config (one env kind may appear under several task names)
    env_id: str
    group_id: str
    seed: int
    iteration: int
    token_ids: list[Int32]  # whole conversation: system, user, assistant turns
    loss_mask: list[Int8]  # 1 only on model-generated tokens
    behaviour_logprobs: list[Float32]  # per token; 0.0 where loss_mask == 0
    token_versions: list[int]  # policy version per token; -1 where loss_mask == 0
    allowed_token_ids: list[Int32] | None = None  # sampling restriction the log-probs are under
    allowed_sequences: list[list[Int32]] | None = None  # answer grammar, if sampled under one
    grammar: str | None = None  # token grammar (JSON), if sampled under one
    turns: list[Turn] = field(default_factory=list)
    env_return: float = 0.0  # sum of env rewards (task reward + format penalties)
    task_return: float = 0.0  # sum of task rewards alone
    format_penalty: float = 0.0  # sum of per-turn format penalties (<= 0)
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    format_errors: Int32 = 0
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
        """The shard row: field values as they are, not copied (`dataclasses.asdict` deep-copies
        every token list: ~60 ms of GIL for a 64-episode batch, against ~3 ms, on the CPU worker
        that hands that batch to the trainer meanwhile). Read it; do not keep or change it."""
        row = {name: getattr(self, name) for name in _TRAJECTORY_FIELDS}
        row["turns"] = [{name: getattr(t, name) for name in _TURN_FIELDS} for t in self.turns]
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


_TRAJECTORY_FIELDS = tuple(f.name for f in fields(Trajectory))
_TURN_FIELDS = tuple(f.name for f in fields(Turn))
# Derived from the dataclasses (rollart/arrow_schema.py): a new field is a new column.
TURN_SCHEMA = arrow_type(Turn)
TRAJECTORY_SCHEMA = arrow_schema(Trajectory)


def trajectories_to_table(trajs: list[Trajectory]) -> pa.Table:
    return pa.Table.from_pylist([t.to_row() for t in trajs], schema=TRAJECTORY_SCHEMA)


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    return [Trajectory.from_row(r) for r in table.to_pylist()]
