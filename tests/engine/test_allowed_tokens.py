"""``allowed_token_ids`` (vLLM's): only those ids are ever chosen. Greedy output equals a plain
Hugging Face decode restricted to them, with every drafter; with ``logit_bias`` the bias of
an allowed id still applies; a grammar that allows none of them ends the request with an
error naming the field."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structspec import SamplingParams
from structspec.constraints import ChoiceConstraint
from tests.engine.hf_reference import hf_greedy

PROMPT = "The capital of France is"
MAX_TOKENS = 16


def _hf_greedy(model_dir: str, tokenizer: Any, allowed: list[int],
               bias: dict[int, float]) -> list[int]:
    """Reference: greedy over ``allowed`` only, ``bias`` added to their logits."""
    def restrict(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        for t, b in bias.items():
            masked[t] += b
        return masked

    return hf_greedy(model_dir, tokenizer.encode(PROMPT, add_special_tokens=False),
                     MAX_TOKENS, restrict)


def test_allowed_token_ids_equal_the_reference_with_every_drafter(
        make_llm: Any, tiny_model_dir: str, tiny_drafters: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = make_llm(model=tiny_model_dir).generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), raw_prompt=True)[0]
    # the plain output's tokens minus its first choice, and a few others: the restricted
    # output must differ from the plain one
    allowed = sorted(set(plain.token_ids[1:6]) | {5, 17, 1000, 2024, 30000})
    assert plain.token_ids[0] not in allowed
    bias = {allowed[0]: 3.0, 7: 50.0}  # 7 is not allowed: its bias must not make it so
    want = _hf_greedy(tiny_model_dir, tokenizer, allowed, {allowed[0]: 3.0})
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed,
                            logit_bias=bias)
    self_draft = dict(speculative_algorithm="draft_model", draft_model=tiny_model_dir,
                      num_draft_tokens=5, speculative_depth=3, speculative_topk=2)
    for name, opts in {"none": {}, "self_draft": self_draft, "ngram": tiny_drafters["ngram"],
                       "eagle": tiny_drafters["eagle"]}.items():
        out = make_llm(model=tiny_model_dir, **opts).generate(PROMPT, params,
                                                              raw_prompt=True)[0]
        assert out.token_ids == want, name
        assert set(out.token_ids) <= set(allowed)


def test_a_grammar_that_allows_none_of_them_ends_with_an_error(make_llm: Any,
                                                                tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    firsts = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    allowed = [t for t in (5, 17, 1000) if t not in firsts]
    llm = make_llm(model=tiny_model_dir)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, allowed_token_ids=allowed,
                                              grammar=ChoiceConstraint(["yes", "no"])),
                       raw_prompt=True)[0]
    assert out.finish_reason == "abort" and out.error_param == "allowed_token_ids"
    assert "allowed_token_ids" in out.error and out.token_ids == []
    # the same grammar with one of its first tokens allowed generates that answer
    word = "no"
    first = tokenizer.encode(word, add_special_tokens=False)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=False,
                                              allowed_token_ids=[*allowed, *first,
                                                                 *sorted(llm_eos(llm))],
                                              grammar=ChoiceConstraint(["yes", "no"])),
                       raw_prompt=True)[0]
    assert out.text == word and out.error is None


def llm_eos(llm: Any) -> set[int]:
    """The engine's EOS ids (the grammar's end needs one of them allowed)."""
    return set(llm.engine.tokenizer.eos_token_ids)


@pytest.mark.parametrize(("value", "match"), [
    ([], "allowed_token_ids must be None or a non-empty list"),
    ([1, -2], "allowed_token_ids must be None or a non-empty list"),
    ([1.0], "allowed_token_ids must be None or a non-empty list"),
    ("12", "allowed_token_ids must be None or a non-empty list"),
])
def test_bad_allowed_token_ids_are_an_error_naming_them(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(allowed_token_ids=value).validate()


def test_an_id_outside_the_vocabulary_is_refused(make_llm: Any, tiny_model_dir: str) -> None:
    out = make_llm(model=tiny_model_dir).generate(
        PROMPT, SamplingParams(max_tokens=2, allowed_token_ids=[3, 10**6]), raw_prompt=True)[0]
    assert out.finish_reason == "abort" and out.error_param == "allowed_token_ids"


def test_min_tokens_with_only_stop_tokens_allowed_is_refused(make_llm: Any,
                                                              tiny_model_dir: str) -> None:
    """No token could meet min_tokens: refused naming it (the ban would otherwise be lifted
    as for a complete grammar, and the output end at once)."""
    llm = make_llm(model=tiny_model_dir)
    eos = sorted(llm_eos(llm))
    for params in (SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=eos),
                   SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=[17],
                                  stop_token_ids=[17])):
        out = llm.generate(PROMPT, params, raw_prompt=True)[0]
        assert out.finish_reason == "abort" and out.error_param == "min_tokens", out
    ok = llm.generate(PROMPT, SamplingParams(max_tokens=4, min_tokens=3, ignore_eos=True,
                                             allowed_token_ids=eos), raw_prompt=True)[0]
    assert ok.error is None and len(ok.token_ids) == 4  # EOS does not stop: not a stop token
