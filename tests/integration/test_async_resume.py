"""An asynchronous run (max_staleness 1) interrupted after a checkpoint and resumed accounts for
every sample id (issue 15, item 6): the groups the rollout service held unconsumed at the
checkpoint are saved with it and handed back, not generated again.

Real components: the in-process loop (`run_local`: the flow's stage functions, services,
Checkpointer and store), the local store on disk. Also with two rollout shards
(rollart/rollout/shards.py): each saves its own groups, and each gets its own back.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollart.config import load_config
from rollart.rollout.ids import group_of_sample
from rollart.runner.local_loop import run_local
from rollart.storage.checkpointing import audit_ledger
from rollart.storage.ledger import SampleLedger
from rollart.storage.store import RunStore
from rollart.types import table_to_trajectories

pytestmark = pytest.mark.integration

CONFIG = str(Path(__file__).parents[2] / "configs/default.yaml")
RUN = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2", "eval.episodes=0",
       "reward.backend=local", "rollout.max_staleness=1", "storage.save_every=2",
       "storage.keep_last=5", "storage.background_upload=false"]


class Interrupted(Exception):
    pass


def groups_of(state: dict) -> list[dict]:
    """The groups of a rollout_state.json, from every shard of a sharded one."""
    if state.get("format") == "sharded":
        return [g for part in state["shards"] if part for g in part["groups"]]
    return state["groups"]


@pytest.mark.parametrize("shards", [1, 2])
def test_async_run_interrupted_and_resumed_accounts_for_every_sample_id(tmp_path, shards):
    cfg = load_config(CONFIG, [f"storage.root={tmp_path}", *RUN, "iterations=4",
                               f"rollout.shards={shards}"])
    store = RunStore(str(tmp_path), "async")

    def crash_after_checkpoint_2(row):
        if row["iter"] == 1:  # iteration 1 = step 2: its checkpoint is written (not background)
            raise Interrupted

    with pytest.raises(Interrupted):
        run_local(cfg, "async", on_iteration=crash_after_checkpoint_2)
    assert store.list_checkpoints() == [2]
    files, manifest = store.load_checkpoint(2)
    # The rollout service held groups for update 2 (started under version 1) when it was saved.
    state = json.loads(files["rollout_state.json"])
    assert (state.get("format") == "sharded") == (shards > 1)
    groups = groups_of(state)
    assert groups, "nothing was pending at the checkpoint: the test proves nothing"
    held = [e for g in groups for e in g["finished"]]
    running = [e for g in groups for e in g["running"]]
    pending = {t.sample_id: t for t in table_to_trajectories(
        pq.read_table(io.BytesIO(files["pending.parquet"])))} if held else {}
    assert sorted(pending) == sorted(held)
    ledger2 = SampleLedger.from_json(files["ledger.json"])
    assert sorted(ledger2.ids("pending")) == sorted(held) and manifest["ledger"]["ok"]

    out = run_local(cfg, "async", resume=True)
    assert out["resumed_from"] == 2
    final, man4 = store.load_checkpoint(4, only=["ledger.json"])
    ledger = SampleLedger.from_json(final["ledger.json"])
    audit = audit_ledger(ledger, cfg, 4)
    assert audit.ok and man4["ledger"]["ok"], audit.as_dict()
    counts = Counter(ledger.ids())
    assert max(counts.values()) == 1  # no sample id twice
    fate = {r[0]: (r[2], r[4]) for r in ledger.records}
    # Every id issued before the checkpoint has its one fate: held ones consumed or dropped,
    # running ones dropped as interrupted; none pending any more.
    assert all(fate[e][0] in ("consumed", "dropped") for e in held)
    assert all(fate[e] == ("dropped", "interrupted") for e in running)
    assert not ledger.ids("pending")
    # The held samples were used as saved, not generated again: the shard of their iteration
    # has the very trajectories the checkpoint carried.
    shards = {t.sample_id: t for t in store.read_shards()}
    for e in held:
        if fate[e][0] == "consumed":
            assert shards[e].token_ids == pending[e].token_ids
            assert shards[e].token_versions == pending[e].token_versions
    # Every group of the 4 iterations has records (settled ones are checked by the audit).
    assert {group_of_sample(e) for e in ledger.ids()} >= {g["group_id"] for g in groups}
