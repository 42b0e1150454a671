"""The sample-id ledger: what happened to every sample the rollout was asked to produce.

Every episode has a deterministic id from the plan (`{task}/i{iteration}/g{group}/m{member}`).
The trainer records each sample's fate exactly once, in the same process and checkpoint as the
weights it changed:

- `consumed`: used by the policy update that produced train step `step`;
- `dropped`: will never be used, with a reason (`env_error`, `no_model_tokens`, ...);
- `pending`: complete but not yet consumed when the checkpoint was taken (the trajectories are
  stored in the checkpoint as `pending.parquet` and handed back on resume).

Recording a consumed or dropped sample twice raises: a sample can never be used twice within
one lineage. A checkpoint also stores `next_iteration`, the plan cursor: every sample of
iterations below it was issued. The audit (`audit`) then checks, for the checkpoint, that
issued == consumed + dropped + pending with no id twice and none missing. Updates that were
never checkpointed are rolled back on resume together with their ledger entries, so their
samples are issued again under the same ids and consumed once in the surviving lineage.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CONSUMED, DROPPED, PENDING = "consumed", "dropped", "pending"


class LedgerError(RuntimeError):
    """A sample would be used twice (or an impossible transition)."""


@dataclass
class LedgerAudit:
    issued: int
    consumed: int
    dropped: int
    pending: int
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected)

    def as_dict(self) -> dict[str, Any]:
        return {"issued": self.issued, "consumed": self.consumed, "dropped": self.dropped,
                "pending": self.pending, "ok": self.ok, "duplicates": self.duplicates[:20],
                "missing": self.missing[:20], "unexpected": self.unexpected[:20]}


class SampleLedger:
    """Append-only fate records: (sample_id, iteration, fate, step, reason)."""

    def __init__(self, records: Iterable[list[Any]] = (), next_iteration: int = 0) -> None:
        self.records: list[list[Any]] = [list(r) for r in records]
        self.next_iteration = next_iteration
        self._reindex()

    def _reindex(self) -> None:
        self._final = {r[0]: i for i, r in enumerate(self.records) if r[2] != PENDING}
        self._pending = {r[0] for r in self.records if r[2] == PENDING}

    # ---- recording ---------------------------------------------------------------------------
    def _record(self, sample_id: str, iteration: int, fate: str, step: int, reason: str) -> None:
        if sample_id in self._final:
            prev = self.records[self._final[sample_id]]
            raise LedgerError(
                f"sample {sample_id!r} would be {fate} at step {step} but was already {prev[2]} "
                f"at step {prev[3]}"
            )
        if sample_id in self._pending:  # a restored pending sample is now used or dropped
            self.records = [r for r in self.records if not (r[0] == sample_id and r[2] == PENDING)]
            self._reindex()
        self.records.append([sample_id, int(iteration), fate, int(step), reason])
        self._final[sample_id] = len(self.records) - 1

    def consume(self, samples: Iterable[tuple[str, int]], step: int) -> int:
        n = 0
        for sid, it in samples:
            self._record(sid, it, CONSUMED, step, "")
            n += 1
        return n

    def drop(self, samples: Iterable[tuple[str, int, str]], step: int) -> int:
        n = 0
        for sid, it, reason in samples:
            self._record(sid, it, DROPPED, step, reason)
            n += 1
        return n

    def set_pending(self, samples: Iterable[tuple[str, int]], step: int) -> None:
        """Replace the pending set (complete, unconsumed samples at checkpoint time)."""
        self.records = [r for r in self.records if r[2] != PENDING]
        self._reindex()
        for sid, it in samples:
            if sid in self._final:
                prev = self.records[self._final[sid]][2]
                raise LedgerError(f"pending sample {sid!r} was already {prev}")
            self.records.append([sid, int(it), PENDING, int(step), ""])
            self._pending.add(sid)

    # ---- queries -----------------------------------------------------------------------------
    def fate(self, sample_id: str) -> str | None:
        for r in reversed(self.records):
            if r[0] == sample_id:
                return str(r[2])
        return None

    def ids(self, fate: str | None = None) -> list[str]:
        return [r[0] for r in self.records if fate is None or r[2] == fate]

    def counts(self) -> dict[str, int]:
        c = Counter(r[2] for r in self.records)
        return {CONSUMED: c[CONSUMED], DROPPED: c[DROPPED], PENDING: c[PENDING]}

    def audit(self, issued_ids: Iterable[str]) -> LedgerAudit:
        issued = list(issued_ids)
        seen = Counter(r[0] for r in self.records)
        issued_set = set(issued)
        c = self.counts()
        return LedgerAudit(
            issued=len(issued_set), consumed=c[CONSUMED], dropped=c[DROPPED], pending=c[PENDING],
            duplicates=sorted(s for s, n in seen.items() if n > 1),
            missing=sorted(issued_set - set(seen)),
            unexpected=sorted(set(seen) - issued_set),
        )

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_json(self) -> bytes:
        body = {"format": 1, "next_iteration": self.next_iteration,
                "columns": ["sample_id", "iteration", "fate", "step", "reason"],
                "records": self.records}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> SampleLedger:
        body = json.loads(data)
        return cls(body["records"], int(body.get("next_iteration", 0)))
