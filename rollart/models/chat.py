"""ChatML conversation pieces in token space.

The episode loop builds each conversation incrementally from these pieces, so it knows exactly
which tokens came from the model (loss mask 1) and which did not. For a tokenizer whose encoding is
compositional at special tokens and newlines (ours is, see `tokenizer.py`), the concatenation

    system(s) + user(u) + assistant_header() + enc(answer) + assistant_end()

equals `tokenizer.apply_chat_template([system, user, assistant])` exactly, so a stored
conversation can be re-tokenized identically from its text.

Layout of one message: `<|im_start|>{role}\\n{content}<|im_end|>\\n`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the flow process imports this without transformers
    from transformers import PreTrainedTokenizerBase

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatFormat:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        # A fast tokenizer's own (Rust) encoder: the ids `tokenizer.encode` gives, without its
        # Python wrapping (a third of a rollout turn's CPU at thousands of episodes).
        backend = getattr(tokenizer, "backend_tokenizer", None) \
            if getattr(tokenizer, "is_fast", False) else None
        self._fast = backend.encode if backend is not None else None
        self.im_start_id = self._single(IM_START)
        self.eos_id = self._single(IM_END)
        self._newline = self.encode("\n")
        self._header = [self.im_start_id, *self.encode("assistant\n")]

    def _single(self, token: str) -> int:
        ids = self.encode(token)
        if len(ids) != 1:
            raise ValueError(f"tokenizer must encode {token!r} as one token, got {ids}")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, no BOS/EOS added (special-token strings in `text` are matched)."""
        if self._fast is not None:
            return self._fast(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def message(self, role: str, content: str) -> list[int]:
        return [self.im_start_id, *self.encode(f"{role}\n{content}"), self.eos_id, *self._newline]

    def system(self, text: str) -> list[int]:
        return self.message("system", text)

    def user(self, text: str) -> list[int]:
        return self.message("user", text)

    def assistant_header(self) -> list[int]:
        """`<|im_start|>assistant\\n`: appended after the last user message, before generating."""
        return list(self._header)

    def first_prompt(self, system: str, observation: str) -> list[int]:
        """An episode's opening: system message, first observation, assistant header."""
        return self.system(system) + self.user(observation) + self.assistant_header()

    def next_prompt(self, observation: str) -> list[int]:
        """What follows an assistant turn: the next observation and the assistant header."""
        return self.user(observation) + self.assistant_header()

    def assistant_end(self) -> list[int]:
        """`<|im_end|>\\n`: closes an assistant turn the model did not close itself."""
        return [self.eos_id, *self._newline]

    def end_after_eos(self) -> list[int]:
        """`\\n`: closes an assistant turn whose last generated token was `<|im_end|>`."""
        return list(self._newline)
