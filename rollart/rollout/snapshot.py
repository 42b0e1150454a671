"""Pending groups across a checkpoint (issue 15, item 6).

In an asynchronous run (max_staleness >= 1) the rollout service holds, when a checkpoint is
taken, groups that no update consumed yet: complete ones, and ones still running with some
members finished. Without them a resume would start those groups again from scratch, reusing
member ids whose earlier fate (finished, dropped) is lost, and drops not yet handed to the
trainer would vanish. So the checkpoint stores:

- `pending.parquet`: the finished members' trajectories (the ledger marks them `pending`);
- `rollout_state.json` (`snapshot`): per group its plan position, start version, launched and
  failure counts, finished and running member ids; the scheduler's plan cursor per task; drops
  not yet recorded.

`restore` puts them back into a new rollout service before it starts: complete groups are
consumed as they would have been (same trajectories, same start versions, so staleness is
judged the same), unfinished groups get new members with new ids (`launched` continues), and
members that were running when the checkpoint was taken are dropped as `interrupted`. Every
sample id issued before the checkpoint thus ends consumed or dropped exactly once. In a
synchronous run the service holds nothing at a checkpoint and this is a no-op.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rollart.rollout.shards import check_state_shards
from rollart.types import Trajectory

if TYPE_CHECKING:
    from rollart.rollout.service import RolloutService

FORMAT = 1
INTERRUPTED = "interrupted"  # ledger drop reason: running when the checkpoint was taken


def snapshot(svc: RolloutService) -> tuple[bytes, list[Trajectory]]:
    """(rollout_state.json, finished trajectories of unconsumed groups), taken consistently."""
    with svc.lock:
        svc._record_discarded()  # dropped groups' finishers become drops first
        state = svc.sched.export_state()
        finished = [e for g in state["groups"] for e in g["finished"]]
        trajs = [svc.done[e] for e in finished]
        state.update(format=FORMAT, drops=[list(d) for d in svc.totals.drops],
                     launch_order=sorted(finished, key=lambda e: svc._launched.get(e, 0)))
    return json.dumps(state, sort_keys=True).encode(), trajs


def restore(svc: RolloutService, data: bytes, trajs: list[Trajectory]) -> dict[str, int]:
    """Load a snapshot into `svc` (created, not started). Returns what was restored."""
    state = json.loads(data)
    check_state_shards(state, 1)
    if state.get("format") != FORMAT:
        raise ValueError(f"rollout_state.json format {state.get('format')!r} is not {FORMAT}")
    by_id = {t.sample_id: t for t in trajs}
    missing = [e for g in state["groups"] for e in g["finished"] if e not in by_id]
    if missing:
        raise ValueError(f"pending trajectories missing from the checkpoint: {missing[:5]}")
    with svc.lock:
        relaunch = svc.sched.import_state(state)
        for e in state["launch_order"]:  # batches list members in launch order
            svc.done[e] = by_id[e]
            svc._launched[e] = next(svc._seq)
        svc.totals.drops += [(str(e), int(it), str(r)) for e, it, r in state["drops"]]
        interrupted = [(e, int(g["iteration"]), INTERRUPTED) for g in state["groups"]
                       for e in g["running"]]
        svc.totals.drops += interrupted
        svc.deferred += relaunch  # launched by start(), once the batchers run
    return {"groups": len(state["groups"]), "finished": len(by_id),
            "relaunched": len(relaunch), "interrupted": len(interrupted)}
