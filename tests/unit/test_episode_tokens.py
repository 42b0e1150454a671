"""An episode's token bookkeeping (rollart/rollout/episode_step.py), by hand: which tokens the
loss trains on, their behaviour log-probs and versions, built once by `finish_episode`."""

from rollart.config import TaskConfig
from rollart.rollout.episode_step import (
    EpisodeSpec,
    begin_episode,
    finish_episode,
    new_episode,
    record_completion,
    record_step,
)
from rollart.types import Completion


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
