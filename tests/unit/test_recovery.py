"""The restart policy of rollart/runner/recovery.py without a cluster: which failures restart the
run, how many times, and the clear failure when there is nothing to restart from. Services are plain
objects whose calls fail the way a lost worker's do (the real kills are in
tests/integration/test_service_restart.py and test_engine_failover.py)."""

from types import SimpleNamespace

import pytest

from rollart.runner.recovery import lost_service, run_with_restarts


class _Service:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def _answer(self):
        if not self.alive:
            raise OSError("Unable to contact Actor's worker")
        return {}

    where = stats = _answer


class _Driver:
    """Fails in `iterations` with `error`; its trainer / rollout service answer or not."""

    def __init__(self, error: Exception | None, trainer_alive=True, rollout_alive=True):
        self.error = error
        self.svc = SimpleNamespace(trainer=_Service(trainer_alive),
                                   rollout=_Service(rollout_alive))
        self.aborted = self.resumed_from = None

    def start(self, resume_step):
        self.resumed_from = resume_step
        return 0

    def iterations(self, first, on_iteration=None, stop_when=None):
        if self.error is not None:
            raise self.error
        return [{"iteration": 0.0}]

    def finish(self):
        return {"done": True}

    def abort(self):
        self.aborted = True

    def release(self):
        self.released = True


def test_lost_service_names_the_one_that_does_not_answer():
    assert lost_service(_Driver(None)) is None
    assert lost_service(_Driver(None, trainer_alive=False)) == "trainer"
    assert lost_service(_Driver(None, rollout_alive=False)) == "rollout service"


def test_a_failure_with_the_services_alive_is_not_retried():
    drivers = [_Driver(ValueError("a bug"))]
    with pytest.raises(ValueError, match="a bug"):
        run_with_restarts(lambda a: drivers[a], store=None, max_restarts=2, resume_step=None)
    assert drivers[0].aborted


def _store_with_checkpoints(tmp_path, steps):
    from rollart.storage.store import RunStore

    store = RunStore(str(tmp_path), "r")
    store.write_text("config.yaml", "name: x\n")
    for step in steps:
        store.save_checkpoint(step, {"model.bin": b"w"}, {"iteration": step - 1})
    return store


def test_restarts_from_the_latest_checkpoint_then_gives_up(tmp_path):
    store = _store_with_checkpoints(tmp_path, [2, 4])
    drivers = [_Driver(OSError("gone"), trainer_alive=False),
               _Driver(OSError("gone"), rollout_alive=False), _Driver(None)]
    driver, curve, done, restarts = run_with_restarts(
        lambda a: drivers[a], store, max_restarts=2, resume_step=None)
    assert driver is drivers[2] and done == {"done": True}
    assert [d.resumed_from for d in drivers] == [None, 4, 4]
    assert [(r["lost"], r["from_checkpoint"]) for r in restarts] == [("trainer", 4),
                                                                    ("rollout service", 4)]
    assert len(store.read_jsonl("resumes.jsonl")) == 2  # each restart is a recorded resume
    always = [_Driver(OSError("gone"), rollout_alive=False) for _ in range(3)]
    with pytest.raises(RuntimeError, match=r"rollout service was lost again after 1 restart"):
        run_with_restarts(lambda a: always[a], store, max_restarts=1, resume_step=None)


def test_before_the_first_checkpoint_there_is_nothing_to_restart_from(tmp_path):
    store = _store_with_checkpoints(tmp_path, [])
    with pytest.raises(RuntimeError, match="lost before the run's first complete checkpoint"):
        run_with_restarts(lambda a: _Driver(OSError("gone"), trainer_alive=False), store,
                          max_restarts=2, resume_step=None)


def test_a_rerun_update_is_refused_before_it_touches_the_policy(tmp_path):
    """A finished `update` stage that Dask runs again (its result lived on a worker that died)
    must not apply the batch twice: the real trainer refuses any step but its next one, with
    its weights, step and ledger untouched; the run then goes on."""
    from pathlib import Path

    from rollart.config import load_config
    from rollart.run import RunSpec
    from rollart.runner.driver import InProcessRunner, IterationDriver
    from rollart.runner.local_loop import LocalServices
    from rollart.services.trainer import UpdateOutOfOrder

    class Keeping(InProcessRunner):  # keeps what each stage returned
        def __init__(self) -> None:
            self.values: dict[str, object] = {}

        def submit(self, stage, *args, after=()):
            done = super().submit(stage, *args, after=after)
            self.values[stage] = done
            return done

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "default.yaml"), [
        "rollout.num_groups=2", "rollout.group_size=2", "tasks.0.max_turns=2",
        "eval.episodes=0", "reward.backend=local", "iterations=2", f"storage.root={tmp_path}"])
    run, runner = RunSpec(cfg, "rerun"), Keeping()
    driver = IterationDriver(run, runner, LocalServices(run))
    driver.start()
    try:
        driver.iteration(0)
        trainer = driver.svc.trainer
        before = (trainer.fingerprint(), trainer.trainer.step, trainer.ckpt.ledger.counts())
        with pytest.raises(UpdateOutOfOrder, match="update for step 1 reached a trainer at "
                                                   "step 1"):
            runner.submit("update", trainer, runner.values["score"], 1)
        assert (trainer.fingerprint(), trainer.trainer.step,
                trainer.ckpt.ledger.counts()) == before
        with pytest.raises(UpdateOutOfOrder):  # nor a step that skips one
            runner.submit("update", trainer, runner.values["score"], 3)
        driver.iteration(1)  # the next update is accepted
        assert trainer.trainer.step == 2
        driver.finish()
    except BaseException:
        driver.abort()
        raise
