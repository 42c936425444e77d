"""``bad_words`` (vLLM's): greedy output equals a plain Hugging Face decode that applies vLLM's
rule at each step (``vllm/v1/sample/ops/bad_words.py``: a sequence's last token is -inf where
the output so far ends with its other tokens), with and without every drafter. The words are
taken from the unconstrained output, so each test fails without the ban; the multi-token word
is matched inside the draft trees (self-drafting accepts most drafts, so the word's tokens
usually sit in one tree)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structspec import SamplingParams
from structspec.bad_words import bad_word_sequences
from structspec.constraints import ChoiceConstraint
from tests.engine.hf_reference import hf_greedy

PROMPTS = ["Once upon a time", "The capital of France is"]
MAX_TOKENS = 24


def _hf_greedy(model_dir: str, tokenizer: Any, prompt: str, seqs: list[list[int]]
               ) -> list[int]:
    """Reference: a plain Hugging Face decode with vLLM's bad-words rule over the output."""

    def ban(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for s in seqs:
            k = len(s) - 1
            if k <= len(out) and out[len(out) - k:] == s[:-1]:
                logits[s[-1]] = float("-inf")
        return logits

    return hf_greedy(model_dir, tokenizer.encode(prompt, add_special_tokens=False), MAX_TOKENS,
                     ban)


def _contains(out: list[int], seq: list[int]) -> bool:
    return any(out[i:i + len(seq)] == seq for i in range(len(out) - len(seq) + 1))


def _pick_word(tokenizer: Any, plain: list[int], length: int) -> tuple[str, list[list[int]]]:
    """A word whose vLLM sequences include one of ``length`` tokens that the plain output
    holds (so the ban changes the output)."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for j in range(1, len(plain) - length + 1):
        word = tokenizer.decode(plain[j:j + length])
        if not word.strip():
            continue
        seqs = bad_word_sequences([word], encode)
        if any(len(s) == length and _contains(plain, s) for s in seqs):
            return word, seqs
    raise AssertionError(f"no {length}-token word found in {plain}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def plain_outputs(make_llm: Any, tiny_model_dir: str) -> list[list[int]]:
    llm = make_llm(model=tiny_model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, raw_prompt=True)]


def test_bad_words_equal_the_reference_with_every_drafter(
        make_llm: Any, tiny_model_dir: str, tiny_drafters: dict, tokenizer: Any,
        plain_outputs: list[list[int]]) -> None:
    params, want = [], []
    for prompt, plain in zip(PROMPTS, plain_outputs, strict=True):
        for length in (1, 3):
            word, seqs = _pick_word(tokenizer, plain, length)
            params.append(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                         bad_words=[word]))
            want.append(_hf_greedy(tiny_model_dir, tokenizer, prompt, seqs))
            assert want[-1] != plain and not any(_contains(want[-1], s) for s in seqs)
    prompts = [p for p in PROMPTS for _ in range(2)]
    self_draft = dict(speculative_algorithm="draft_model", draft_model=tiny_model_dir,
                      num_draft_tokens=5, speculative_depth=3, speculative_topk=2)
    for name, opts in {"none": {}, "self_draft": self_draft, "ngram": tiny_drafters["ngram"],
                       "eagle": tiny_drafters["eagle"]}.items():
        outs = make_llm(model=tiny_model_dir, **opts).generate(prompts, params, raw_prompt=True)
        assert [o.token_ids for o in outs] == want, name
        if name == "self_draft":  # the words' tokens were verified inside trees
            assert sum(o.spec.draft_tokens_accepted for o in outs) > 0


def test_a_grammar_allowing_only_a_bad_token_ends_with_an_error(
        make_llm: Any, tiny_model_dir: str, tokenizer: Any) -> None:
    """A one-token word is -inf before the grammar mask (like ``allowed_token_ids``): a choice
    that can only be written with it (one character, one token) leaves no token, and the
    request ends with an error naming ``bad_words``; with another choice, that one is taken.
    (A longer choice could still be written with other tokens, as in vLLM: a word bans its
    own tokenizations only.)"""
    llm = make_llm(model=tiny_model_dir)
    assert tokenizer.encode("y", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("y")]
    outs = [llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, grammar=ChoiceConstraint(c),
                                                    bad_words=["y"]), raw_prompt=True)[0]
            for c in (["y"], ["y", "n"])]
    assert outs[0].finish_reason == "abort" and outs[0].error_param == "bad_words"
    assert outs[1].text == "n" and outs[1].error is None


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(bad_words=[""]), "bad_words must be None or a list of strings"),
    (dict(bad_words=["  "]), "bad_words must be None or a list of strings"),
    (dict(bad_words=[3]), "bad_words must be None or a list of strings"),
    (dict(bad_words=5), "bad_words must be None or a list of strings"),
    (dict(bad_words=["w"] * 129), "bad_words has 129 entries"),
    (dict(bad_words=["x" * 257]), r"bad_words\[0\] has 257 characters"),
])
def test_bad_bad_words_is_an_error_naming_it(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate()


def test_engine_refuses_a_word_it_cannot_tokenize(make_llm: Any, tiny_model_dir: str) -> None:
    from structspec.core import RequestError

    llm = make_llm(model=tiny_model_dir)
    with pytest.raises(RequestError, match="bad_words") as e:
        llm.engine.add_request("hi", SamplingParams(bad_words=["a\ud800"]))
    assert e.value.param == "bad_words"
