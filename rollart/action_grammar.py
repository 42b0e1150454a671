"""Token grammar: constrained decoding for turn languages the answer trie cannot list.

The answer trie (rollart.answer_trie) holds a finite list of whole turns. A tool call with a
free expression, or an integer answer, is a regular language of astronomically many strings, so
an env describes it as alternatives of segments instead (`Env.action_grammar`): a literal
string, or `[charset, min, max]` (min..max characters drawn from charset). `TokenGrammar` lifts
that character language to one tokenizer's tokens and answers `allowed_next(prefix)` exactly
like `AnswerTrie`.

A grammar crosses processes as a string (`dump_grammar`: JSON with the end-of-turn id and a
digest of the vocabulary it was built for), in `SamplingParams.grammar` and
`Trajectory.grammar`. The HF engine (per sampled token) and the trainer (per model token of a
stored trajectory) rebuild it with `token_grammar(grammar, texts)` over the same token texts
and call the same `turn_walker(...).allowed_next`, so the log-probs the engine records and the
ones the trainer recomputes are under the same per-position restriction; the digest turns a
vocabulary mismatch into an error instead of silently different masks.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rollart.answer_trie import AnswerTrie, answer_trie

Segment = str | tuple[str, int, int] | list[Any]
Alternatives = list[list[Segment]]
_Pos = tuple[int, int, int]  # (alternative, segment, characters consumed in it)


@dataclass(frozen=True, eq=False)
class TokenTexts:
    """Each token id's decoded text, "" for special tokens (never allowed by a grammar).

    Compared and hashed by `digest`, so a cache lookup keyed on it does not hash ~49k strings
    per sampled token."""

    texts: tuple[str, ...]
    digest: str

    @classmethod
    def of(cls, texts: Sequence[str]) -> TokenTexts:
        texts = tuple(texts)
        digest = hashlib.sha1("\x00".join(texts).encode("utf-8", "surrogatepass")).hexdigest()
        return cls(texts, digest[:16])

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenTexts) and other.digest == self.digest


_TEXTS: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: Any) -> TokenTexts:
    """The token texts of `tokenizer` (cached per tokenizer object): `decode([id])`, which for
    byte-level BPE (SmolLM2) and the local Metaspace BPE (rollart.models.tokenizer) is the
    token's exact share of any decoded text. ~0.1 s for SmolLM2's 49,152 tokens."""
    cached = _TEXTS.get(tokenizer)
    if cached is not None:
        return cached
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None) \
        if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    out = TokenTexts.of("" if i in special else t for i, t in enumerate(texts))
    _TEXTS[tokenizer] = out
    return out


def dump_grammar(alternatives: Alternatives, eos_id: int, texts: TokenTexts) -> str:
    """The grammar as it travels (sampling params, trajectories, shards): canonical JSON."""
    alts = [[s if isinstance(s, str) else [str(s[0]), int(s[1]), int(s[2])] for s in alt]
            for alt in alternatives]
    return json.dumps({"alternatives": alts, "eos_id": int(eos_id), "vocab": texts.digest},
                      sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=32)
def token_grammar(grammar: str, texts: TokenTexts) -> TokenGrammar:
    """The (cached) `TokenGrammar` of a `dump_grammar` string over `texts`: every request and
    trajectory of a task carries the same string, so one grammar (and its explored states) is
    built per process. ValueError if the grammar was made for another vocabulary."""
    spec = json.loads(grammar)
    if spec["vocab"] != texts.digest:
        raise ValueError(f"grammar was built for vocabulary {spec['vocab']}, not this "
                         f"tokenizer's ({texts.digest}): its masks would differ")
    return TokenGrammar(spec["alternatives"], texts.texts, spec["eos_id"])


def turn_walker(grammar: str | None, sequences: Sequence[Sequence[int]] | None,
                texts: TokenTexts | None) -> TokenGrammar | AnswerTrie | None:
    """What restricts each token of a turn, in the one order the engine and trainer share: a
    token grammar, else an answer trie, else None (the token bag alone, or nothing)."""
    if grammar is not None:
        if texts is None:
            raise ValueError("a token grammar needs the tokenizer's token texts (Trainer("
                             "token_texts=...)) to rebuild the engine's masks")
        return token_grammar(grammar, texts)
    if sequences:
        return answer_trie(sequences)
    return None


class TokenGrammar:
    """Token-level view of a segment grammar (see the module docstring) for one vocabulary.

    A token is allowed after `prefix` if its whole text keeps the character language alive;
    end of turn (`eos_id`) is allowed where an alternative is complete. A prefix that left the
    grammar (cannot happen under the grammar's own sampling) gets end of turn alone. States are
    explored lazily and cached, by a walk of a character trie of the vocabulary restricted to
    the grammar's alphabet (a few hundred tokens of SmolLM2's 49,152); those tokens and end of
    turn are `bag`, the restriction for engines that cannot walk the grammar (vLLM)."""

    def __init__(self, alternatives: Alternatives, token_texts: Sequence[str],
                 eos_id: int) -> None:
        self.alts = [[s if isinstance(s, str) else (str(s[0]), int(s[1]), int(s[2]))
                      for s in alt] for alt in alternatives]
        if not self.alts or any(not alt for alt in self.alts):
            raise ValueError("a token grammar needs non-empty alternatives")
        self.eos_id = int(eos_id)
        alphabet = {c for alt in self.alts for s in alt for c in (s if isinstance(s, str)
                                                                   else s[0])}
        self._vocab: dict[str, Any] = {}  # char trie: char -> node; node[""] = token ids
        ids = {self.eos_id}
        for tid, text in enumerate(token_texts):
            if text and tid != self.eos_id and set(text) <= alphabet:
                node = self._vocab
                for c in text:
                    node = node.setdefault(c, {})
                node.setdefault("", []).append(tid)
                ids.add(tid)
        self.bag = tuple(sorted(ids))
        self.start = self._close({(a, 0, 0) for a in range(len(self.alts))})
        self._cache: dict[frozenset[_Pos], tuple[tuple[int, ...], dict[int, frozenset[_Pos]]]] = {}

    def allowed_next(self, prefix: Sequence[int]) -> tuple[int, ...]:
        state = self.start
        for tok in prefix:
            nxt = self._expand(state)[1].get(int(tok))
            if nxt is None:
                return (self.eos_id,)
            state = nxt
        return self._expand(state)[0] or (self.eos_id,)

    def _expand(self, state: frozenset[_Pos]) -> tuple[tuple[int, ...],
                                                       dict[int, frozenset[_Pos]]]:
        if state not in self._cache:
            moves: dict[int, frozenset[_Pos]] = {}
            stack: list[tuple[dict[str, Any], frozenset[_Pos]]] = [(self._vocab, state)]
            while stack:
                node, here = stack.pop()
                for key, child in node.items():
                    if key == "":
                        continue
                    there = self._step(here, key)
                    if there:
                        for tid in child.get("", ()):
                            moves[tid] = there
                        stack.append((child, there))
            allowed = set(moves) | ({self.eos_id} if self._accepts(state) else set())
            self._cache[state] = (tuple(sorted(allowed)), moves)
        return self._cache[state]

    def _accepts(self, state: frozenset[_Pos]) -> bool:
        return any(seg == len(self.alts[a]) for a, seg, _ in state)

    def _step(self, state: frozenset[_Pos], ch: str) -> frozenset[_Pos]:
        out: set[_Pos] = set()
        for a, seg, k in state:
            if seg == len(self.alts[a]):
                continue
            s = self.alts[a][seg]
            if isinstance(s, str):
                if s[k] == ch:
                    out.add((a, seg, k + 1))
            elif ch in s[0] and k < s[2]:
                out.add((a, seg, k + 1))
        return self._close(out)

    def _close(self, positions: set[_Pos]) -> frozenset[_Pos]:
        """Add the positions reachable without a character (a finished literal, or a run that
        has its minimum length, may move on to the next segment)."""
        todo, seen = list(positions), set(positions)
        while todo:
            a, seg, k = todo.pop()
            if seg == len(self.alts[a]):
                continue
            s = self.alts[a][seg]
            done = k == len(s) if isinstance(s, str) else k >= s[1]
            if done and (a, seg + 1, 0) not in seen:
                seen.add((a, seg + 1, 0))
                todo.append((a, seg + 1, 0))
        return frozenset(p for p in seen if p[0] < len(self.alts) and (
            p[1] == len(self.alts[p[0]]) or not isinstance(self.alts[p[0]][p[1]], str)
            or p[2] < len(self.alts[p[0]][p[1]])))
