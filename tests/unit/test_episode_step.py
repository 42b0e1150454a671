"""The one episode-step routine (rollart/rollout/episode_step.py), driven by hand: the actions it
hands out, what each env answer and each failure does to the trajectory, the same rules
through its blocking driver (`take`) and evaluation's batched one (`run_episodes`), and an
episode's token bookkeeping (which tokens the loss trains on, their behaviour log-probs and
versions, built once by `finish_episode`)."""

from __future__ import annotations

from typing import Any

import pytest

from rollart.config import TaskConfig
from rollart.rollout import env_manager
from rollart.rollout.batcher import EpisodeCancelled, LiveEpisode
from rollart.rollout.episode_step import (
    OPEN,
    EpisodeSpec,
    EpisodeSteps,
    Generate,
    Step,
    begin_episode,
    finish_episode,
    new_episode,
    record_completion,
    record_step,
    reissue_turn,
    route_turn,
    take,
)
from rollart.rollout.failover import NoReplicaLeft
from rollart.rollout.scheduler import Start
from rollart.routing.router import NoHealthyReplica
from rollart.types import Completion, GenerationRequest, SamplingParams

PARAMS = SamplingParams(max_new_tokens=4)
SPEC = EpisodeSpec(TaskConfig(name="guess", env_id="guess"), seed=7, group_id="g", sample_id="s")


class Chat:
    """The chat format's glue as short, recognisable ids."""

    def first_prompt(self, system: str, observation: str) -> list[int]:
        return [1, 2, 3]

    def next_prompt(self, observation: str) -> list[int]:
        return [7, 8]

    def end_after_eos(self) -> list[int]:
        return [9]

    def assistant_end(self) -> list[int]:
        return [5, 9]


class GuessTwo:
    """A hand-written env: guess the number 2 in at most 3 turns, as `<answer>N</answer>`.
    Feedback each turn; a turn without the tags pays -0.1 (format_ok False); the third turn
    without success is truncated (the env's max turns); "CRASH" makes `step` raise."""

    system_prompt = "Guess a number from 0 to 3."

    def __init__(self) -> None:
        self.turn, self.closed = 0, False

    def reset(self, seed: int) -> tuple[str, dict]:
        self.turn = 0
        return "Guess.", {}

    def step(self, text: str) -> tuple[str, float, bool, bool, dict]:
        if text == "CRASH":
            raise RuntimeError("env crashed")
        self.turn += 1
        ok = text.startswith("<answer>") and text.endswith("</answer>")
        guess = int(text[8:-9]) if ok else None
        penalty = 0.0 if ok else -0.1
        success = guess == 2
        obs = ("Answer as <answer>N</answer>." if not ok else "Right." if success
               else "Higher." if guess < 2 else "Lower.")
        info = {"action": None if guess is None else str(guess), "format_ok": ok,
                "success": success, "task_reward": 1.0 if success else 0.0,
                "format_penalty": penalty}
        truncated = not success and self.turn >= 3
        return obs, (1.0 if success else 0.0) + penalty, success, truncated, info

    def close(self) -> None:
        self.closed = True


def comp(rid: str, ids: list[int], text: str, finish: str = "eos") -> Completion:
    return Completion(rid, ids, [-0.5] * len(ids), text, finish, weight_version=3)


def test_turns_with_feedback_a_malformed_answer_and_the_env_turn_limit() -> None:
    env, seen = GuessTwo(), []
    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64,
                         on_turn=lambda t0, eid, turn: seen.append((eid, turn)))
    assert steps.start() is OPEN
    first = steps.advance(("sys", "Guess.", None), seconds=0.5)
    assert first == Generate(first.request, new_tokens=3)
    assert (first.request.request_id, first.request.prompt_ids) == ("s#t0", [1, 2, 3])
    assert first.request.params is PARAMS

    texts = ["<answer>1</answer>", "maybe 2", "<answer>3</answer>"]
    action: Any = first
    for turn, text in enumerate(texts):
        assert type(action) is Generate and action.request.request_id == f"s#t{turn}"
        step = steps.advance(comp(f"s#t{turn}", [4 + turn], text), seconds=1.0)
        assert step == Step(text)
        action = steps.advance(env.step(text), seconds=0.25)
    assert action is None  # truncated at the env's third turn

    t = steps.finish()
    assert [(u.observation, u.response, u.action, u.format_ok, u.env_reward) for u in t.turns] == [
        ("Guess.", "<answer>1</answer>", "1", True, 0.0),
        ("Higher.", "maybe 2", None, False, -0.1),
        ("Answer as <answer>N</answer>.", "<answer>3</answer>", "3", True, 0.0),
    ]
    assert (t.env_return, t.task_return, t.format_penalty, t.format_errors) == (-0.1, 0.0, -0.1, 1)
    assert (t.success, t.terminated, t.truncated, t.error) == (False, False, True, None)
    assert [u.prompt_tokens for u in t.turns] == [3, 2, 2]
    assert [u.env_s for u in t.turns] == [0.25, 0.25, 0.25]
    assert steps.timings == {"generate_s": 3.0, "env_s": 1.25}  # 0.5 to open, 3 x 0.25
    assert t.token_ids == [1, 2, 3, 4, 9, 7, 8, 5, 9, 7, 8, 6, 9]
    assert t.loss_mask == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert steps.reason == "env_error" and seen == [("s", 0), ("s", 1), ("s", 2)]


def test_success_ends_the_episode_through_the_blocking_driver() -> None:
    env, answers = GuessTwo(), iter(["<answer>0</answer>", "<answer>2</answer>"])

    def perform(action: Any) -> Any:
        if type(action) is Generate:
            return comp(action.request.request_id, [4], next(answers))
        if type(action) is Step:
            return env.step(action.text)
        return "sys", env.reset(SPEC.seed)[0], None

    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64)
    action = steps.start()
    while action is not None:
        action = take(steps, action, perform)
    t = steps.finish()
    assert (t.num_turns, t.env_return, t.task_return, t.format_errors) == (2, 1.0, 1.0, 0)
    assert (t.success, t.terminated, t.truncated, t.error) == (True, True, False, None)
    assert [u.observation for u in t.turns] == ["Guess.", "Higher."]


def test_an_env_crash_ends_the_episode_as_an_env_error() -> None:
    env = GuessTwo()
    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64)
    steps.start()
    steps.advance(("sys", "Guess.", None), seconds=0.5)
    assert steps.advance(comp("s#t0", [4], "CRASH"), seconds=1.0) == Step("CRASH")
    with pytest.raises(RuntimeError) as crash:
        env.step("CRASH")
    assert steps.fail(crash.value, seconds=0.25) is None
    t = steps.finish()
    assert (t.error, steps.reason, steps.ep.done) == ("step: RuntimeError: env crashed",
                                                      "env_error", True)
    assert t.turns == [] and t.token_ids == [1, 2, 3, 4, 9]  # the completion is kept
    assert steps.timings == {"generate_s": 1.0, "env_s": 0.75}


def test_a_failed_reset_ends_the_episode_before_any_token() -> None:
    def perform(action: Any) -> Any:
        raise ValueError("no such env")

    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64)
    assert take(steps, steps.start(), perform) is None
    t = steps.finish()
    assert (t.error, steps.reason, t.token_ids) == ("reset: ValueError: no such env",
                                                    "env_error", [])


@pytest.mark.parametrize("err, error, reason, fatal, cancelled", [
    # cancelled by whoever accounts for it (the service stopping, a stale group): quiet
    (EpisodeCancelled(), None, "env_error", False, True),
    # its batcher stopped under it, nobody cancelled it: a failure, never a finished episode
    (EpisodeCancelled(), "generate: the engine's batcher stopped", "engine_error", False, False),
    (NoReplicaLeft("none left"), None, "env_error", True, False),
    (RuntimeError("boom"), "generate: RuntimeError: boom", "engine_error", False, False),
])
def test_a_failed_generation_costs_what_the_policy_says(err: Exception, error: str | None,
                                                        reason: str, fatal: bool,
                                                        cancelled: bool) -> None:
    fatals: list[BaseException] = []
    flag = {"cancelled": False}
    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64, on_fatal=fatals.append,
                         cancelled=lambda: flag["cancelled"])
    steps.start()
    steps.advance(("sys", "Guess.", None), seconds=0.5)
    flag["cancelled"] = cancelled
    assert steps.fail(err, seconds=2.0) is None
    t = steps.finish()
    assert (t.error, steps.reason, fatals == [err]) == (error, reason, fatal)
    assert steps.timings == {"generate_s": 0.0, "env_s": 0.5}  # no turn: no generate time


def test_no_completion_or_a_cancel_ends_the_episode_without_stepping_the_env() -> None:
    stop = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64)
    stop.start()
    stop.advance(("sys", "Guess.", None))
    assert stop.advance(None, seconds=1.0) is None  # no replica left, the service stops
    assert stop.finish().error is None and stop.timings["generate_s"] == 1.0

    cancelled = [False]
    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64, cancelled=lambda: cancelled[0])
    steps.start()
    assert type(steps.advance(("sys", "Guess.", None))) is Generate
    cancelled[0] = True
    assert steps.advance(comp("s#t0", [4], "<answer>2</answer>")) is None
    assert steps.finish().token_ids == [1, 2, 3]  # the turn is not recorded

    never = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64, cancelled=lambda: True)
    never.start()
    assert never.advance(("sys", "Guess.", None)) is None  # cancelled while opening


def test_the_context_budget_truncates_before_the_next_observation() -> None:
    # 3 prompt + 2 turn + 2 next prompt + 4 max new tokens = 11 > 10
    steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=10)
    steps.start()
    steps.advance(("sys", "Guess.", None))
    steps.advance(comp("s#t0", [4], "<answer>1</answer>"))
    assert steps.advance(("Higher.", 0.0, False, False, {"format_ok": True})) is None
    t = steps.finish()
    assert (t.truncated, t.terminated, t.token_ids, t.error) == (True, False, [1, 2, 3, 4, 9],
                                                                  None)


def test_a_broken_turn_costs_the_episode_in_the_service_and_raises_in_evaluation() -> None:
    bad = ("Higher.", "a lot", False, False, {})  # a reward that is not a number
    for contain in (True, False):
        steps = EpisodeSteps(SPEC, Chat(), PARAMS, max_context=64, contain_errors=contain)
        steps.start()
        steps.advance(("sys", "Guess.", None))
        steps.advance(comp("s#t0", [4], "<answer>1</answer>"))
        if contain:
            assert steps.advance(bad) is None
            assert steps.finish().error == ("generate: ValueError: could not convert string "
                                            "to float: 'a lot'")
            assert steps.reason == "engine_error"
        else:
            with pytest.raises(ValueError):
                steps.advance(bad)


def test_evaluation_runs_the_same_rules_in_lockstep(monkeypatch: pytest.MonkeyPatch) -> None:
    envs: list[GuessTwo] = []

    def make_env(task: TaskConfig) -> GuessTwo:
        envs.append(GuessTwo())
        return envs[-1]

    monkeypatch.setattr(env_manager, "make_env", make_env)
    # episode "a" guesses 1, 3, then malformed until its turns run out; "b" crashes its env
    script = {"a": ["<answer>1</answer>", "<answer>3</answer>", "two"],
              "b": ["<answer>1</answer>", "CRASH"]}
    calls: list[list[str]] = []

    def generate(requests: list) -> list[Completion]:
        calls.append([r.request_id for r in requests])
        return [comp(r.request_id, [4], script[r.request_id[0]][int(r.request_id[3:])])
                for r in requests]

    specs = [EpisodeSpec(SPEC.task, seed=i, group_id="g", sample_id=sid)
             for i, sid in enumerate(["a", "b"])]
    done: list[str] = []
    out = env_manager.run_episodes(specs, generate, Chat(), PARAMS, max_context=64,
                                   on_done=lambda t: done.append(t.sample_id))
    assert calls == [["a#t0", "b#t0"], ["a#t1", "b#t1"], ["a#t2"]]
    assert done == ["b", "a"] and [t.sample_id for t in out] == ["a", "b"]
    a, b = out
    assert (a.num_turns, a.env_return, a.format_penalty, a.format_errors) == (3, -0.1, -0.1, 1)
    assert (a.truncated, a.success, a.error) == (True, False, None)
    assert (b.num_turns, b.error) == (1, "step: RuntimeError: env crashed")
    assert b.token_ids == [1, 2, 3, 4, 9, 7, 8, 4, 9]
    assert all(e.closed for e in envs) and len(envs) == 2
    assert set(a.timings) == {"generate_s", "env_s"}


class Routing:
    def __init__(self, raises: bool = False) -> None:
        self.raises, self.abandoned = raises, []

    def route(self, *args: Any) -> int:
        if self.raises:
            raise NoHealthyReplica("none")
        return 1

    def abandon(self, request_id: str) -> None:
        self.abandoned.append(request_id)


class Svc:
    def __init__(self, routing: Routing) -> None:
        self.routing, self.lost = routing, []
        self.totals = type("Totals", (), {"counters": {"turns_reissued": 0}})()

    def engine_lost(self, engine: int, err: BaseException) -> None:
        self.lost.append(engine)


def test_a_turn_goes_again_only_when_its_replica_is_lost() -> None:
    live = LiveEpisode(Start("s", "g", "guess", 7, 0), engine=0, host=0)
    req = GenerationRequest("s#t0", [1, 2, 3], PARAMS)
    assert route_turn(Svc(Routing()), live, req, 3) == 1
    assert route_turn(Svc(Routing(raises=True)), live, req, 3) is None  # look again later

    svc = Svc(Routing())
    assert reissue_turn(svc, 1, req, OSError("connection closed"))  # the replica is gone
    assert svc.lost == [1] and svc.totals.counters["turns_reissued"] == 1
    assert not reissue_turn(svc, 1, req, EpisodeCancelled())
    assert not reissue_turn(svc, 1, req, ValueError("bad request"))  # the engine's own error
    assert svc.routing.abandoned == ["s#t0"] and svc.lost == [1]


def test_mask_logprobs_and_versions_of_a_two_turn_episode():
    chat = Chat()
    ep = new_episode(EpisodeSpec(TaskConfig(), seed=0, group_id="g", sample_id="s"))
    begin_episode(ep, chat, "system", "obs 0")  # [1, 2, 3]
    first = Completion("s#t0", [4, 4], [-0.1, -0.2], "a", "eos", 3)
    record_completion(ep, first, chat)  # [4, 4] generated at version 3, then [9]
    record_step(ep, first, ("obs 1", 0.0, False, False, {"format_ok": True}), 0.01, chat,
                max_context=1024, max_new_tokens=2)  # [7, 8]
    second = Completion("s#t1", [6], [-0.3], "b", "length", 4)
    record_completion(ep, second, chat)  # [6] at version 4, then [5, 9]: not closed by eos
    record_step(ep, second, ("obs 2", 1.0, True, False, {"format_ok": True}), 0.01, chat,
                max_context=1024, max_new_tokens=2)
    assert ep.done
    assert ep.traj.loss_mask == []  # built at the end, not turn by turn

    t = finish_episode(ep)
    assert t.token_ids == [1, 2, 3, 4, 4, 9, 7, 8, 6, 5, 9]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0]
    assert t.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, 0.0]
    assert t.token_versions == [-1, -1, -1, 3, 3, -1, -1, -1, 4, -1, -1]
    assert t.num_model_tokens == 3
    assert [u.prompt_tokens for u in t.turns] == [3, 2]
    assert finish_episode(ep) is t and len(t.loss_mask) == 11  # twice: nothing added


def test_an_episode_that_failed_before_any_token_finishes_empty():
    ep = new_episode(EpisodeSpec(TaskConfig(), seed=0, group_id="g", sample_id="s"))
    t = finish_episode(ep)
    assert t.token_ids == t.loss_mask == t.behaviour_logprobs == t.token_versions == []
