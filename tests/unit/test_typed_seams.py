"""The seams between the driver, the stages and the services are typed: a misspelled service
method, a wrong argument or a misused answer is a mypy error (`make typecheck`), not a failure
at run time on a cluster. `call(handle).method(*args)` keeps `call`'s deadline and errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.handles import CallTimeoutError, call, call_while_present

ROOT = Path(__file__).resolve().parents[2]
# Checked with the real modules that define the seam; everything they import is skipped (Any),
# which keeps this to a few seconds.
SEAM = ["rollart/handles.py", "rollart/service_protocols.py", "rollart/types.py"]

SNIPPET = '''
from rollart.handles import call, call_while_present
from rollart.service_protocols import EngineAPI, RolloutAPI, TrainerAPI


def good(trainer: TrainerAPI, engine: EngineAPI, rollout: RolloutAPI) -> float:
    out = call(trainer, while_alive=True).update([], None, 3)
    version: int = call(engine, timeout=5.0).weight_version()
    trajs, info = call_while_present(rollout).take_batch(version)
    return float(out["metrics"]["train/loss"]) + len(trajs) + len(info)


def bad(trainer: TrainerAPI, engine: EngineAPI) -> None:
    call(trainer, while_alive=True).updte([], None, 3)
    call(trainer).save_checkpoint("seven", {})
    name: str = call(engine).weight_version()
    call(engine, timeout="soon").fingerprint()
    call(trainer).publish_weights()["versoin"]
'''


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file=", "--no-incremental",
         "--follow-imports=skip", "--ignore-missing-imports", "--python-version=3.10",
         "--show-error-codes", "--no-error-summary", str(snippet), *SEAM],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_mypy_reports_a_misspelled_method_a_wrong_argument_and_a_misused_answer(tmp_path):
    """Also a wrong deadline and a misspelled key of a typed answer."""
    got = _mypy(tmp_path, SNIPPET)
    errors = [line for line in got.stdout.splitlines() if ": error:" in line]
    assert got.returncode == 1, got.stdout + got.stderr
    assert all(line.startswith(str(tmp_path / "snippet.py")) for line in errors), errors
    text = "\n".join(errors)
    assert re.search(r':14: error: "TrainerAPI" has no attribute "updte"', text), text
    assert re.search(r':15: error: Argument 1 to "save_checkpoint" of "TrainerAPI" has '
                     r'incompatible type "str"; expected "int"', text), text
    assert re.search(r':16: error: Incompatible types in assignment \(expression has type '
                     r'"int", variable has type "str"\)', text), text
    assert re.search(r':17: error: No overload variant of "call" matches', text), text
    assert re.search(r':18: error: TypedDict "WeightsPublished" has no key "versoin"', text), text
    assert len(errors) == 5, text  # `good` is clean


def test_no_method_is_named_by_a_string_in_the_driver_and_the_stages():
    untyped = re.compile(r"""\b(call|call_while_present|_tolerant)\([^()]*?,\s*["']""")
    for rel in ("rollart/runner/driver.py", "rollart/runner/stages.py"):
        text = (ROOT / rel).read_text()
        assert not untyped.findall(text), f"{rel}: a call names its method by a string"
        assert "hasattr(" not in text, f"{rel}: a capability checked by name"


class Service:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def add(self, a: int, b: int = 0) -> int:
        self.calls.append((a, b))
        return a + b


class NeverAnswers:
    """A future that never completes (a hung actor's call)."""

    def result(self, timeout: float | None = None) -> None:
        raise TimeoutError


class Hung:
    def work(self, n: int) -> NeverAnswers:
        return NeverAnswers()


def test_the_typed_form_calls_the_method_once_with_call_semantics():
    svc = Service()
    assert call(svc).add(2, b=3) == 5
    assert call(svc, timeout=None).add(4) == 4
    assert call_while_present(svc, poll_s=0.1).add(1, 1) == 2
    assert call(svc, "add", 7) == 7  # the untyped form still answers alike
    assert svc.calls == [(2, 3), (4, 0), (1, 1), (7, 0)]
    assert repr(call(svc)) == "call(Service)"
    with pytest.raises(AttributeError, match="ad"):
        call(svc).ad(1)  # a plain object: the missing method raises as before
    with pytest.raises(CallTimeoutError, match=r"Hung\.work did not answer within 0\.05s"):
        call(Hung(), timeout=0.05).work(1)  # the deadline names the service and the method
    with pytest.raises(CallTimeoutError, match=r"Hung\.work did not answer within 0\.05s"):
        call(Hung(), "work", 1, timeout=0.05)


class Rank:
    def __init__(self, rank: int, fail: bool = False) -> None:
        self.rank, self.fail, self.seen = rank, fail, []

    def update(self, trajs, dropped=None, step=None):
        self.seen.append(("update", step))
        if self.fail:
            raise RuntimeError(f"rank {self.rank} failed")
        return {"metrics": {"rank": float(self.rank)}, "version": step}

    def weight_version(self):
        self.seen.append(("weight_version", None))
        return 7

    def flush_checkpoints(self, timeout=None):
        self.seen.append(("flush", timeout))
        return [{"rank": self.rank}]

    def where(self):
        return {"worker": f"w{self.rank}", "address": f"tcp://r{self.rank}"}


def test_a_trainer_group_fans_typed_calls_out_and_answers_with_rank_0():
    from rollart.services.trainer_group import TrainerGroup

    ranks = [Rank(0), Rank(1)]
    group = TrainerGroup(ranks)  # type: ignore[list-item]  (plain stand-ins for the ranks)
    assert group.update([], None, 3) == {"metrics": {"rank": 0.0}, "version": 3}
    assert group.weight_version() == 7  # asked of rank 0 alone
    assert group.flush_checkpoints(2.0) == [{"rank": 0}]
    assert group.where() == {"worker": "w0", "address": "tcp://r0",
                             "ranks": ["tcp://r0", "tcp://r1"]}
    assert ranks[0].seen == [("update", 3), ("weight_version", None), ("flush", 2.0)]
    assert ranks[1].seen == [("update", 3), ("flush", 2.0)]
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        TrainerGroup([Rank(0), Rank(1, fail=True)]).update([], None, 4)  # type: ignore[list-item]
