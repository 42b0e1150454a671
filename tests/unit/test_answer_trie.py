"""The answer grammar (rollart.answer_trie) and the trainer's per-position restriction."""

import pytest

from rollart.answer_trie import AnswerTrie, answer_trie
from rollart.train.trainer import collate
from rollart.types import Trajectory

SEQS = [[1, 2, 9], [1, 3, 9]]  # "<answer>", action 2 or 3, end of turn 9


def test_trie_allows_exactly_the_continuations_of_the_prefix():
    trie = AnswerTrie(SEQS)
    assert trie.allowed_next([]) == (1,)
    assert trie.allowed_next([1]) == (2, 3)
    assert trie.allowed_next([1, 3]) == (9,)
    # Off the tree or past the end: the bag of every token, never an empty set.
    assert trie.allowed_next([1, 2, 9]) == (1, 2, 3, 9)
    assert trie.allowed_next([4]) == (1, 2, 3, 9)
    assert answer_trie(SEQS) is answer_trie([list(s) for s in SEQS])  # one tree per grammar
    with pytest.raises(ValueError, match="non-empty"):
        AnswerTrie([[1], []])


def _traj(ids: list[int], mask: list[int], **kw) -> Trajectory:
    return Trajectory(sample_id="s", task="t", env_id="e", group_id="g", seed=0, iteration=0,
                      token_ids=ids, loss_mask=mask, behaviour_logprobs=[0.0] * len(ids),
                      token_versions=[0 if m else -1 for m in mask], **kw)


def test_collate_restricts_each_target_to_what_the_engine_could_sample():
    # system 5 5 | turn: 1 2 9 | observation 6 | turn: 1 3 (cut by the token budget)
    grammar = _traj([5, 5, 1, 2, 9, 6, 1, 3], [0, 0, 1, 1, 1, 0, 1, 1],
                    allowed_token_ids=[1, 2, 3, 9], allowed_sequences=SEQS)
    bag = _traj([5, 1, 3], [0, 1, 1], allowed_token_ids=[1, 3])
    free = _traj([5, 7], [0, 1])
    b = collate([grammar, bag, free], pad_id=0, vocab_size=10)
    allowed = b.allowed_table[b.allowed_idx]  # [B, T-1, V]

    def ids(row: int, target: int) -> list[int]:  # target j is token j + 1
        return allowed[row, target].nonzero()[:, 0].tolist()

    assert [ids(0, j) for j in (1, 2, 3)] == [[1], [2, 3], [9]]  # tokens 2..4: one turn
    assert [ids(0, j) for j in (5, 6)] == [[1], [2, 3]]  # a new turn starts at the root again
    assert ids(1, 0) == ids(1, 1) == [1, 3]  # bag: the same set at every model token
    assert ids(2, 0) == list(range(10))  # unconstrained
    # Micro-batches slice the rows but share the table.
    mb = b.select(slice(1, 3))
    assert mb.allowed_table is b.allowed_table and mb.allowed_idx.shape[0] == 2
    assert collate([free], pad_id=0, vocab_size=10).allowed_table is None
