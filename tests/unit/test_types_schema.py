"""The shard schema is derived from the Trajectory / Turn dataclasses and is byte-for-byte the
schema shards were written with before (the hand-kept copy is frozen here as the reference)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field, fields

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollart.arrow_schema import Float32, Int32, arrow_schema, arrow_type
from rollart.types import (
    TRAJECTORY_SCHEMA,
    Trajectory,
    Turn,
    table_to_trajectories,
    trajectories_to_table,
)

_KV = pa.list_(pa.struct([("key", pa.string()), ("value", pa.float64())]))
# The schema as it was hand-written in rollart/types.py, plus the columns added since
# (allowed_sequences: the answer grammar; grammar: the token grammar); shards on disk carry
# exactly this.
WRITTEN_BEFORE = pa.schema([
    ("sample_id", pa.string()), ("task", pa.string()), ("env_id", pa.string()),
    ("group_id", pa.string()), ("seed", pa.int64()), ("iteration", pa.int64()),
    ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("behaviour_logprobs", pa.list_(pa.float32())), ("token_versions", pa.list_(pa.int64())),
    ("allowed_token_ids", pa.list_(pa.int32())),
    ("allowed_sequences", pa.list_(pa.list_(pa.int32()))),
    ("grammar", pa.string()),
    ("turns", pa.list_(pa.struct([
        ("index", pa.int32()), ("observation", pa.string()), ("response", pa.string()),
        ("action", pa.string()), ("format_ok", pa.bool_()), ("env_reward", pa.float64()),
        ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
        ("weight_version", pa.int64()), ("generate_s", pa.float64()), ("env_s", pa.float64()),
    ]))),
    ("env_return", pa.float64()), ("task_return", pa.float64()),
    ("format_penalty", pa.float64()), ("success", pa.bool_()), ("terminated", pa.bool_()),
    ("truncated", pa.bool_()), ("format_errors", pa.int32()), ("error", pa.string()),
    ("reward", pa.float64()), ("reward_details", _KV), ("advantage", pa.float64()),
    ("timings", _KV),
])


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_derived_schema_is_the_schema_shards_were_written_with(make_traj):
    assert TRAJECTORY_SCHEMA.equals(WRITTEN_BEFORE, check_metadata=True)
    assert TRAJECTORY_SCHEMA.serialize().to_pybytes() == WRITTEN_BEFORE.serialize().to_pybytes()
    rows = [make_traj(i).to_row() for i in range(2)]
    assert _parquet_bytes(trajectories_to_table([make_traj(i) for i in range(2)])) \
        == _parquet_bytes(pa.Table.from_pylist(rows, schema=WRITTEN_BEFORE))
    # A shard written before allowed_sequences and grammar existed still reads (the columns
    # default).
    older = pa.schema([f for f in WRITTEN_BEFORE
                       if f.name not in ("allowed_sequences", "grammar")])
    for row in rows:
        del row["allowed_sequences"], row["grammar"]
    back = table_to_trajectories(pa.Table.from_pylist(rows, schema=older))
    assert [t.allowed_sequences for t in back] == [None, None]
    assert [t.grammar for t in back] == [None, None]
    assert [t.sample_id for t in back] == [make_traj(i).sample_id for i in range(2)]


@dataclass
class _Extended(Trajectory):
    prm_scores: list[Float32] = field(default_factory=list)
    judge: str | None = None
    verdicts: dict[str, Int32] = field(default_factory=dict)


def test_a_new_dataclass_field_is_a_new_column():
    schema = arrow_schema(_Extended)
    assert schema.names == WRITTEN_BEFORE.names + ["prm_scores", "judge", "verdicts"]
    assert schema.field("prm_scores").type == pa.list_(pa.float32())
    assert schema.field("judge").type == pa.string() and schema.field("judge").nullable
    assert schema.field("verdicts").type == pa.list_(
        pa.struct([("key", pa.string()), ("value", pa.int32())]))


def test_unmappable_types_fail_naming_the_field():
    @dataclass
    class Bad:
        ok: int
        both: int | str

    with pytest.raises(TypeError, match=r"Bad\.both: only `X \| None` unions"):
        arrow_schema(Bad)
    with pytest.raises(TypeError, match="no Arrow type"):
        arrow_type(set[int])


def test_shard_rows_take_the_trajectory_values_without_copying(make_traj):
    """A shard's rows are built on the CPU worker while it hands the same batch to the trainer's
    worker: a deep copy of every token list held that worker's GIL ~60 ms per 64-episode batch
    (docs/benchmarks.md, control plane), so rows refer to the trajectory's own lists."""
    t = make_traj(0)
    row = t.to_row()
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "token_versions"):
        assert row[name] is getattr(t, name)
    assert t.turns and [r["index"] for r in row["turns"]] == [u.index for u in t.turns]
    assert set(row["turns"][0]) == {f.name for f in fields(Turn)}


def test_the_token_grammar_round_trips_through_a_shard(tmp_path, make_traj):
    """A trajectory sampled under a token grammar keeps it through a shard (the trainer of a
    resumed run rebuilds its masks from it), and a trajectory without one reads back None."""
    from rollart.action_grammar import TokenTexts, dump_grammar
    from rollart.envs.calculator import CalculatorEnv
    from rollart.storage.store import RunStore

    grammar = dump_grammar(CalculatorEnv().action_grammar, 3, TokenTexts.of(["a", "b"]))
    trajs = [make_traj(0, allowed_token_ids=[1, 2, 3], grammar=grammar), make_traj(1)]
    table = trajectories_to_table(trajs)
    assert table.schema.field("grammar").type == pa.string()
    assert table.schema.field("grammar").nullable
    store = RunStore(str(tmp_path), "r1")
    store.write_shard(0, trajs)
    back = store.read_shards(0)
    assert [t.grammar for t in back] == [grammar, None]
    assert back[0].allowed_token_ids == [1, 2, 3] and back[0] == trajs[0]
