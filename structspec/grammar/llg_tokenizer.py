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


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable bytes stand for themselves,
    the other 68 (controls, space, 127-160, 173) for the characters from U+0100 on, in byte
    order (the GPT-2 convention every byte-level tokenizer follows)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {chr(b): b for b in keep}
    rest = sorted(set(range(256)) - set(keep))
    out.update((chr(256 + i), b) for i, b in enumerate(rest))
    return out


#: every this-many-th vocabulary id is checked by :func:`check_token_bytes`
_CHECK_STRIDE = 8


def check_token_bytes(tokenizer: llguidance.LLTokenizer, tokenizer_json: str) -> None:
    """Check that llguidance reads the vocabulary tokens of a byte-level BPE as the bytes its
    byte alphabet spells (``Ġ"`` must be `` "``); other tokenizers are not checked.

    Why: llguidance derives token bytes from the tokenizer JSON's decoder, and a decoder it
    misreads (the chain transformers 5.17 saves, module doc) gives masks its own matcher then
    refuses, request after request. This fails the engine's start instead. Every
    :data:`_CHECK_STRIDE`-th id is checked: ~60 ms (warm; ~270 ms the first call) for SmolLM2's 49k vocabulary, most of it
    parsing the JSON.

    Raises:
        ValueError: tokens whose bytes differ (up to three named, with both readings).
    """
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if not (_is_byte_level(spec.get("pre_tokenizer")) and isinstance(vocab, dict)):
        return
    alphabet = _byte_alphabet()
    added = {t.get("id") for t in spec.get("added_tokens") or []}
    wrong = []
    for text, token_id in vocab.items():
        if token_id % _CHECK_STRIDE or token_id in added or token_id >= tokenizer.vocab_size:
            continue  # a sample: a misread decoder misreads whole classes of tokens
        want = bytes(alphabet[c] for c in text) if all(c in alphabet for c in text) else None
        if want is None:
            continue  # not spelled in the byte alphabet (a byte-fallback token such as <0x0A>)
        got = tokenizer.decode_bytes([token_id])
        if got != want:
            wrong.append(f"{token_id} {text!r}: llguidance {got!r}, tokenizer {want!r}")
    if wrong:
        raise ValueError(f"llguidance reads {len(wrong)} tokens of this tokenizer with other "
                         f"bytes than the tokenizer does ({'; '.join(wrong[:3])}): its masks "
                         "would not match its matcher; use --grammar-backend xgrammar")

