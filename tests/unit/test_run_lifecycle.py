"""One run lifecycle for both modes (rollart/runner/lifecycle.py): the in-process mode (`run_local`)
passes the same start checks as the flow (`started_run`, what flows/train.py `_train` enters):
a reused run id is refused unless resuming, a resume may not change a plan-defining key, a run
someone else writes is refused, and a refusal touches nothing of the run and releases the
lock. The flow-mode checks themselves are in tests/unit/test_store_resume.py and
tests/integration/test_store_integrity.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rollart.config import load_config
from rollart.runner.lifecycle import started_run
from rollart.runner.local_loop import run_local
from rollart.runner.recovery import run_with_restarts
from rollart.storage.lock import RunLockedError, run_lock
from rollart.storage.resume import ResumeError
from rollart.storage.store import RunStore

CONFIG = str(Path(__file__).parents[2] / "configs" / "default.yaml")
BASE = ["rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "storage.save_every=1"]


def _untouched(store: RunStore) -> tuple[str, list[int], bool]:
    return store.read_text("config.yaml"), store.list_checkpoints(), store.exists("resumes.jsonl")


def test_in_process_mode_refuses_what_the_flow_refuses(tmp_path):
    overrides = [*BASE, f"storage.root={tmp_path}", "iterations=1"]
    cfg = load_config(CONFIG, overrides)
    run_local(cfg, "r")
    store = RunStore(str(tmp_path), "r")
    assert store.list_checkpoints() == [1]
    before = _untouched(store)

    # A reused run id: refused by both modes, each naming its own way to resume.
    with pytest.raises(ResumeError, match=r"run 'r' already has checkpoints .* resume it with "
                       r"--resume \(flow parameter `resume`\)"):
        with started_run(cfg, "r", resume=False, overrides=overrides):
            pass
    with pytest.raises(ResumeError, match=r"run 'r' already has checkpoints .* resume it with "
                       r"resume=True"):
        run_local(cfg, "r")
    assert _untouched(store) == before

    # A resume that changes a plan-defining key: refused by both modes with the same message.
    for key, value in (("seed", "3"), ("rollout.group_size", "4")):
        changed = load_config(CONFIG, [*overrides, f"{key}={value}", "iterations=2"])
        name = key.split(".")[0]
        with pytest.raises(ResumeError, match=rf"cannot resume 'r' with a different '{name}'"):
            with started_run(changed, "r", resume=True, overrides=[f"{key}={value}"]):
                pass
        with pytest.raises(ResumeError, match=rf"cannot resume 'r' with a different '{name}'"):
            run_local(changed, "r", resume=True)
        assert _untouched(store) == before  # no rollback, no resume record

    # A run another writer holds: refused before any file is touched.
    with run_lock(cfg.storage, "r"), pytest.raises(RunLockedError, match="being written by "
                                                    "another process"):
        run_local(cfg, "r", resume=True)
    assert _untouched(store) == before

    # Every refusal released the lock; a resume with the same plan goes on (and extends it).
    more = load_config(CONFIG, [*BASE, f"storage.root={tmp_path}", "iterations=2"])
    out = run_local(more, "r", resume=True)
    assert out["resumed_from"] == 1 and store.list_checkpoints() == [1, 2]
    assert yaml.safe_load(store.read_text("config.yaml"))["iterations"] == 2
    assert len(store.read_jsonl("resumes.jsonl")) == 1
    with run_lock(cfg.storage, "r") as lock:  # released at the run's end
        assert lock.held


class _Driver:
    def __init__(self, error: BaseException) -> None:
        self.error, self.aborted = error, False
        self.svc = SimpleNamespace(trainer=None, rollout=None)

    def start(self, resume_step):
        return 0

    def iterations(self, first, on_iteration=None, stop_when=None):
        raise self.error

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("error", [ValueError("a bug"), KeyboardInterrupt()])
def test_a_mode_that_cannot_restart_aborts_and_raises_as_is(error):
    drivers: list[_Driver] = []

    def make(attempt: int) -> _Driver:
        drivers.append(_Driver(error))
        return drivers[-1]

    with pytest.raises(type(error)):
        run_with_restarts(make, store=None, max_restarts=None, resume_step=None)
    assert len(drivers) == 1 and drivers[0].aborted  # its threads stopped, nothing retried
