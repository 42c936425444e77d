"""``bad_words`` (vLLM's): the token sequences a request must never generate, from its words.

vLLM tokenizes each word twice (``SamplingParams.update_from_tokenizer`` in
``vllm/sampling_params.py``): ``word.lstrip()`` as is, and with one leading space, without
special tokens. The unprefixed form is always kept (a word that tokenizes to nothing is an
error); the space-prefixed form is kept only when its first token differs from the unprefixed
form's and both have the same length (the space produced a new word token rather than a
separate space token). vLLM v1 then bans, at each position, the last token of every sequence
whose other tokens are the request's last *output* tokens (``vllm/v1/sample/ops/bad_words.py``:
the past tokens are the output token ids, not the prompt; a sequence longer than the output so
far plus one never matches). A one-token sequence is thus banned everywhere.

This module does the host part: the sequences, split into the single tokens (banned through the
request's row of the penalty table, :mod:`structspec.scheduler.penalty_slots`) and the longer
sequences (banned per verify-tree row on the device, :mod:`structspec.layers.bad_words`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_BAD_WORDS = 128
"""Entries of ``bad_words`` a request may give (vLLM's ``VLLM_MAX_NUM_BAD_WORDS`` bounds the
tokenized sequences the same way)."""
MAX_BAD_WORD_CHARS = 256
"""Characters of one ``bad_words`` entry."""
MAX_BAD_WORD_TOKENS = 32
"""Tokens of one tokenized ``bad_words`` sequence: the device ban walks that many tree levels
back per step (:mod:`structspec.layers.bad_words`)."""


@dataclass(frozen=True)
class BadWordIds:
    """A request's tokenized ``bad_words``.

    Attributes:
        single: token ids banned at every output position (the one-token sequences), sorted.
        multi: the sequences of two or more tokens: the last token is banned where the output
            so far ends with the others.
    """

    single: tuple[int, ...]
    multi: tuple[tuple[int, ...], ...]

    @property
    def context_len(self) -> int:
        """Output tokens the longest multi-token sequence looks back at (0 without any)."""
        return max((len(s) - 1 for s in self.multi), default=0)


def bad_word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]
                       ) -> list[list[int]]:
    """vLLM's token sequences of ``words`` (see the module doc), in vLLM's order.

    Args:
        words: the request's ``bad_words``.
        encode: text -> token ids without special tokens.

    Raises:
        ValueError: a word tokenizes to nothing, or a sequence is longer than
            :data:`MAX_BAD_WORD_TOKENS` (messages start with ``bad_words``).
    """
    seqs: list[list[int]] = []
    for i, word in enumerate(words):
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words[{i}] ({word!r}) tokenizes to no token")
        forms = [plain]
        spaced = encode(" " + word.lstrip())
        # the prefixed form only when the space made a different word token of the same
        # length (vLLM's rule; otherwise it is a space token followed by the plain form)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            forms.append(spaced)
        longest = max(len(f) for f in forms)
        if longest > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words[{i}] tokenizes to {longest} tokens; at most "
                             f"{MAX_BAD_WORD_TOKENS}")
        seqs.extend(forms)
    return seqs


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]],
                       vocab_size: int) -> BadWordIds | None:
    """A request's :class:`BadWordIds` (None without words).

    Raises:
        ValueError: as :func:`bad_word_sequences`, or a token id outside ``[0, vocab_size)``
            (a tokenizer with more tokens than the model's logits).
    """
    if not words:
        return None
    seqs = bad_word_sequences(words, encode)
    bad = next((t for s in seqs for t in s if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"bad_words tokenize to token id {bad}, outside the model's "
                         f"vocabulary (size {vocab_size})")
    single = tuple(sorted({s[0] for s in seqs if len(s) == 1}))
    multi = tuple(dict.fromkeys(tuple(s) for s in seqs if len(s) > 1))  # distinct, in order
    return BadWordIds(single=single, multi=multi)
