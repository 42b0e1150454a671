"""Answer-grammar constraint: a turn's completion must spell one of a few token sequences.

A constrained task (`tasks[].constrained`) knows its whole answer language: `<answer>{action}
</answer>` for each action. Restricting sampling to the *bag* of those tokens still lets a
from-scratch model write `</answer><answer>` or stop at once, and on the embedded default ~75 %
of the first iterations' turns carried no action: the policy spent its first ~15 iterations
learning the format before it could learn the task. Walking a trie of the answers instead
leaves exactly one choice that matters (which action), so every turn moves the agent.

The engine and the trainer call the same `allowed_next`, so the log-probs the engine records and
the ones the trainer recomputes are under the same per-position restriction. Turn languages too
large to list (tool calls with free arguments) use rollart.action_grammar's token grammar, which
has the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


class AnswerTrie:
    """Prefix tree over the allowed completions of one turn (token ids).

    Each sequence is a whole turn, end-of-turn token included (`<answer>Left</answer><eos>`),
    so the tree alone says when a turn may end. `allowed_next(prefix)` is the set of tokens
    that keep `prefix` on some sequence. A prefix that left the tree or ran past its end
    (cannot happen under the engine's own sampling, which stops at end of turn) gets the union
    of every token, the plain bag restriction, rather than an empty set."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("an answer grammar needs at least one non-empty token sequence")
        kids: dict[tuple[int, ...], set[int]] = {}
        for seq in sequences:
            seq = tuple(int(t) for t in seq)
            for k in range(len(seq)):
                kids.setdefault(seq[:k], set()).add(seq[k])
        self._children = {k: tuple(sorted(v)) for k, v in kids.items()}
        self.bag = tuple(sorted({t for seq in sequences for t in seq}))

    def allowed_next(self, prefix: Sequence[int]) -> tuple[int, ...]:
        return self._children.get(tuple(prefix), self.bag)


@lru_cache(maxsize=64)
def _cached(key: tuple[tuple[int, ...], ...]) -> AnswerTrie:
    return AnswerTrie(key)


def answer_trie(sequences: Sequence[Sequence[int]]) -> AnswerTrie:
    """The (cached) trie of `sequences`: every request and trajectory of a task carries the
    same few sequences, so one tree per task is built per process."""
    return _cached(tuple(tuple(int(t) for t in s) for s in sequences))
