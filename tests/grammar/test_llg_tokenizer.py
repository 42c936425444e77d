"""The llguidance tokenizer gets the same token bytes whichever transformers version saved
the default model's tokenizer (structspec/grammar/llg_tokenizer.py, ``byte_level_decoder``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar.bitmask import allocate_bitmask
from structspec.grammar.llg_compile import compile_llguidance
from structspec.grammar.llg_matcher import LlgMatcher, decode_mask_row
from structspec.grammar.llg_tokenizer import (
    LlgTokenizerSource,
    byte_level_decoder,
    check_token_bytes,
)

from .conftest import STOP_ID

#: the decoder chain transformers 5.17 saves for the GGUF's byte-level BPE (its
#: ``ByteLevel`` step is the one the tokenizer has anyway)
DECODER_517 = [{"type": "ByteFallback"}, {"type": "Fuse"},
               {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}]


def _as_saved_by_transformers_517(hf_tokenizer: Any) -> PreTrainedTokenizerFast:
    """The same vocabulary with the decoder chain (and byte fallback) of transformers 5.17's
    GGUF conversion; decoding gives the same text."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    if spec["decoder"]["type"] != "ByteLevel":  # this host's transformers saved the chain
        assert [d["type"] for d in spec["decoder"]["decoders"]][-1] == "ByteLevel"
        return hf_tokenizer
    spec["decoder"] = {"type": "Sequence", "decoders": [*DECODER_517, spec["decoder"]]}
    spec["model"]["byte_fallback"] = True
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    ids = hf_tokenizer.encode('{"first_name": "Ann"}', add_special_tokens=False)
    assert tok.decode(ids) == hf_tokenizer.decode(ids)
    return tok


@pytest.mark.parametrize("saved_by", ["5.24", "5.17"])
def test_space_tokens_after_a_key_whatever_the_decoder_chain(hf_tokenizer: Any,
                                                              saved_by: str) -> None:
    tok = hf_tokenizer if saved_by == "5.24" else _as_saved_by_transformers_517(hf_tokenizer)
    vocab = len(hf_tokenizer)
    source = LlgTokenizerSource.from_hf(tok, vocab_size=vocab, stop_token_ids=[STOP_ID])
    llt = source.build()
    space_quote = hf_tokenizer.convert_tokens_to_ids('\u0120"')
    colon = hf_tokenizer.convert_tokens_to_ids(":")
    assert llt.decode_bytes([space_quote]) == b' "'
    schema = {"type": "object", "properties": {"first_name": {"type": "string"}},
              "required": ["first_name"], "additionalProperties": False}
    compiled = compile_llguidance(llt, JsonSchemaConstraint(schema), vocab_size=vocab,
                                  any_whitespace=False, stop_token_ids=[STOP_ID])
    matcher = LlgMatcher(compiled, stop_token_ids=[STOP_ID])
    prefix = hf_tokenizer.encode('{"first_name":', add_special_tokens=False)
    assert matcher.accept_run(prefix) == len(prefix)
    row = allocate_bitmask(1, vocab, pin=False)
    matcher.fill_bitmask(row, 0)
    allowed = set(decode_mask_row(row[0], vocab))
    # the compact separator ": " needs a space next: the mask and the matcher agree on it
    assert space_quote in allowed and colon not in allowed
    assert all(matcher.accept_run([t]) == 1 and matcher.rollback(1) is None
               for t in sorted(allowed)[:8])


def test_byte_level_decoder_leaves_other_tokenizers_alone(hf_tokenizer: Any) -> None:
    text = hf_tokenizer.backend_tokenizer.to_str()
    assert byte_level_decoder(text) == text  # already a plain ByteLevel decoder
    spec = json.loads(text)
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                             "prepend_scheme": "always", "split": False}
    spec["decoder"] = {"type": "Sequence", "decoders": DECODER_517}
    sentencepiece_like = json.dumps(spec)
    assert byte_level_decoder(sentencepiece_like) == sentencepiece_like


def test_token_bytes_check_catches_a_misread_decoder(hf_tokenizer: Any) -> None:
    """The engine-start check: the 5.17-style JSON as it was fed to llguidance before the
    decoder fix is refused (every token outside printable ASCII misread); after the fix, and
    with the 5.24 JSON, it passes."""
    tok = _as_saved_by_transformers_517(hf_tokenizer)
    vocab = len(hf_tokenizer)
    raw = LlgTokenizerSource(tok.backend_tokenizer.to_str(), vocab, (STOP_ID,))
    with pytest.raises(ValueError, match=r"llguidance reads \d+ tokens .*--grammar-backend"):
        check_token_bytes(raw.build(), raw.tokenizer_json)
    for fixed in (LlgTokenizerSource.from_hf(tok, vocab_size=vocab, stop_token_ids=[STOP_ID]),
                  LlgTokenizerSource.from_hf(hf_tokenizer, vocab_size=vocab,
                                             stop_token_ids=[STOP_ID])):
        check_token_bytes(fixed.build(), fixed.tokenizer_json)
