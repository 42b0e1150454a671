"""A small BPE tokenizer trained locally on the task corpus (no hub downloads).

Design (for the tiny config-built policy):

- Pre-tokenization splits on "\\n" (each newline is its own piece) and then uses Metaspace
  (" " -> "▁", split before each space, nothing prepended), with the matching Metaspace decoder.
  That makes `decode(encode(s)) == s` for ASCII text, and makes encoding *compositional* at
  newlines and special tokens: enc(a + b) == enc(a) + enc(b) whenever `a` ends with "\\n" or a
  special/added token sits at the boundary. `ChatFormat` relies on this to build conversations
  in token space that re-tokenize identically.
- The initial alphabet is printable ASCII (space as "▁") plus "\\n" and "\\t", so any such text
  encodes without unknowns; anything else maps to `<unk>` (a byte fallback would cost 256 ids).
- Special tokens `<pad>`, `<unk>`, `<|im_start|>`, `<|im_end|>` (eos) and the added, non-special
  but single-token tags `<think>`, `</think>`, `<answer>`, `</answer>` take the first ids, so
  `len(tokenizer) == vocab_size` when the corpus has enough merges.
- A ChatML chat template is attached, so `apply_chat_template` and save/load round-trip.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, UNK, IM_START, IM_END]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]  # added, not special
ROLES = ("system", "user", "assistant")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ALPHABET = sorted(
    set(string.ascii_letters + string.digits + string.punctuation) | {"▁", "\n", "\t"}
)
_SPLIT_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))


def _training_texts(corpus: Iterable[str]) -> Iterator[str]:
    """Corpus pieces between tags (tags are single tokens already: no merges spent on them), plus
    the ChatML role names once per text, since every conversation carries them."""
    for text in corpus:
        yield from ROLES
        for piece in _SPLIT_RE.split(text):
            if piece:
                yield piece


def build_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a deterministic BPE on `corpus`; `vocab_size` counts special and tag tokens too."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + TAG_TOKENS,
        initial_alphabet=_ALPHABET,
        limit_alphabet=len(_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(corpus), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAG_TOKENS)  # ids already in the vocab: reused, matched as whole tokens

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=IM_START,
        eos_token=IM_END,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
