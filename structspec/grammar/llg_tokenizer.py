"""The llguidance tokenizer of the served model, in a form that travels to other processes
(:class:`LlgTokenizerSource`): the mask worker processes build the same ``LLTokenizer`` as the
engine process from it, without ``transformers``.

llguidance's tokenizer objects cannot be pickled, and its Hugging Face helper
(``llguidance.hf.from_tokenizer``) needs a ``transformers`` tokenizer; what it builds the
``LLTokenizer`` from is the Rust tokenizer's JSON (added tokens included), the logits width
and the EOS ids. That is what this record holds.

llguidance derives each token's bytes from the JSON's *decoder*: a ``ByteLevel`` decoder maps
the byte-level alphabet back to bytes (``Ġ`` -> a space), anything else is read as a
SentencePiece-style vocabulary. transformers 5.17 saves the tokenizer it builds from a GGUF
(the default model) with the decoder chain ``[ByteFallback, Fuse, Replace("▁", " "),
ByteLevel]`` around a byte-level BPE; llguidance then took ``Ġ"`` for the bytes ``c4 a0 22``
instead of `` "``, so no token began with a space: after ``{"key":`` (the compact key separator
``": "`` needs one) its masks allowed only ``:``, which its matcher then refused ("grammar
rejected token 42"). :func:`byte_level_decoder` reduces such a chain to its ``ByteLevel`` step
(the other steps do nothing on a byte-level vocabulary), so every transformers version gives
llguidance the same token bytes.
"""

from __future__ import annotations

import copy
import json
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
        return cls(byte_level_decoder(backend.to_str()), int(vocab_size),
                   tuple(int(t) for t in stop_token_ids))

    def build(self) -> llguidance.LLTokenizer:
        """The ``LLTokenizer`` (~1 s for a 50k vocabulary; build once per process)."""
        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                      eos_token=list(self.eos_token_ids))


def _is_byte_level(part: Any) -> bool:
    """Whether a pre-tokenizer (or one step of a ``Sequence`` of them) is ``ByteLevel``."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "ByteLevel":
        return True
    return part.get("type") == "Sequence" and any(
        _is_byte_level(p) for p in part.get("pretokenizers", []))


def byte_level_decoder(tokenizer_json: str) -> str:
    """``tokenizer_json`` with a byte-level BPE's decoder chain reduced to its ``ByteLevel``
    step (module doc), so that llguidance maps the byte-level alphabet back to bytes; any
    other tokenizer JSON is returned unchanged.

    A byte-level BPE (a ``ByteLevel`` pre-tokenizer) has only byte-alphabet tokens, so the
    ``ByteFallback`` / ``Fuse`` / ``Replace("▁")`` steps some converters put before
    ``ByteLevel`` never change a decoded text: dropping them keeps the text the same.

    Args:
        tokenizer_json: a Rust tokenizer's JSON (``Tokenizer.to_str()``).

    Returns:
        The JSON text, rewritten only when its decoder is a ``Sequence`` holding a
        ``ByteLevel`` step and its pre-tokenizer is ``ByteLevel``.
    """
    spec = json.loads(tokenizer_json)
    decoder = spec.get("decoder")
    if not (isinstance(decoder, dict) and decoder.get("type") == "Sequence"
            and _is_byte_level(spec.get("pre_tokenizer"))):
        return tokenizer_json
    steps = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
    if not steps:
        return tokenizer_json
    spec["decoder"] = steps[-1]
    return json.dumps(spec, ensure_ascii=False)
