"""The llguidance tokenizer of the served model, in a form that travels to other processes
(:class:`LlgTokenizerSource`): the mask worker processes build the same ``LLTokenizer`` as the
engine process from it, without ``transformers``.

llguidance's tokenizer objects cannot be pickled, and its Hugging Face helper
(``llguidance.hf.from_tokenizer``) needs a ``transformers`` tokenizer; what it builds the
``LLTokenizer`` from is the Rust tokenizer's JSON (added tokens included), the logits width
and the EOS ids. That is what this record holds.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance


@dataclass(frozen=True)
class LlgTokenizerSource:
    """What an ``llguidance.LLTokenizer`` is built from (picklable; ~2-10 MB of JSON).

    Attributes:
        tokenizer_json: the Rust tokenizer's JSON (padding and truncation off).
        vocab_size: the model's logits width (>= the tokenizer's size); ids past the
            tokenizer's are never allowed.
        eos_token_ids: the ids that end an output (llguidance's EOS tokens).
    """

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, tokenizer_hf: Any, *, vocab_size: int,
                stop_token_ids: Sequence[int]) -> LlgTokenizerSource:
        """The source of a Hugging Face fast tokenizer (as ``llguidance.hf.from_tokenizer``
        reads it).

        Raises:
            ValueError: a slow (non-Rust) tokenizer.
        """
        backend = getattr(tokenizer_hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("llguidance needs a fast (Rust) Hugging Face tokenizer")
        backend = copy.copy(backend)  # the settings below must not change the caller's
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), int(vocab_size), tuple(int(t) for t in stop_token_ids))

    def build(self) -> llguidance.LLTokenizer:
        """The ``LLTokenizer`` (~1 s for a 50k vocabulary; build once per process)."""
        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                      eos_token=list(self.eos_token_ids))
