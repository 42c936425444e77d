"""vLLM's tokenization of ``bad_words`` (``SamplingParams.update_from_tokenizer`` in
``vllm/sampling_params.py``): the word lstripped, and with one leading space only when that
gives a different first token and the same length; one-token sequences apart."""

from __future__ import annotations

import pytest

from structspec.bad_words import MAX_BAD_WORD_TOKENS, bad_word_sequences, tokenize_bad_words

VOCAB = {"cat": [1], " cat": [2], "big dog": [3, 4], " big dog": [5, 4], "hot": [6],
         " hot": [7, 6], "x y": [8, 9], " x y": [10, 11, 12]}


def _encode(text: str) -> list[int]:
    return list(VOCAB.get(text, []))


def test_the_prefix_space_form_is_kept_only_as_vllm_keeps_it() -> None:
    assert bad_word_sequences(["  cat"], _encode) == [[1], [2]]  # lstripped, then spaced
    assert bad_word_sequences(["big dog"], _encode) == [[3, 4], [5, 4]]
    assert bad_word_sequences(["hot"], _encode) == [[6]]  # " hot" = a space token + "hot"
    assert bad_word_sequences(["x y"], _encode) == [[8, 9]]  # another length: not kept


def test_single_and_multi_token_sequences_are_split() -> None:
    ids = tokenize_bad_words(["cat", "big dog", "hot"], _encode, vocab_size=20)
    assert ids is not None
    assert ids.single == (1, 2, 6) and ids.multi == ((3, 4), (5, 4)) and ids.context_len == 1
    assert tokenize_bad_words([], _encode, vocab_size=20) is None


@pytest.mark.parametrize(("words", "vocab", "match"), [
    (["nothing"], 20, "tokenizes to no token"),
    (["big dog"], 5, "outside the model's vocabulary"),
])
def test_untokenizable_words_are_refused(words: list[str], vocab: int, match: str) -> None:
    with pytest.raises(ValueError, match=f"^bad_words.*{match}"):
        tokenize_bad_words(words, _encode, vocab_size=vocab)


def test_a_word_of_too_many_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^bad_words\[1\] tokenizes to"):
        bad_word_sequences(["ok", "long"], lambda t: list(range(
            MAX_BAD_WORD_TOKENS + (1 if "long" in t else 0))))
