"""``min_tokens``: no stop token and no stop string before a request's first ``min_tokens``
output tokens, exactly per verify-tree row (layers/stop_ban.py): greedy output equals a plain
Hugging Face decode that bans the stop ids at those positions, with and without every drafter;
a grammar's end still ends the request."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structspec import SamplingParams
from structspec.constraints import ChoiceConstraint
from tests.engine.hf_reference import hf_greedy

PROMPTS = ["Once upon a time", "The capital of France is"]
MAX_TOKENS = 24


def _hf_greedy(model_dir: str, tokenizer: Any, prompt: str, stop_ids: set[int],
               min_tokens: int) -> list[int]:
    """Reference: a plain decode with Hugging Face, the stop ids' logits -inf while the
    output is shorter than ``min_tokens``; ends after a stop id (kept) or MAX_TOKENS."""
    banned = sorted(stop_ids)

    def ban(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        if len(out) < min_tokens:
            logits[banned] = float("-inf")
        return logits

    return hf_greedy(model_dir, tokenizer.encode(prompt, add_special_tokens=False), MAX_TOKENS,
                     ban, frozenset(stop_ids))


@pytest.fixture(scope="module")
def plain_outputs(make_llm: Any, tiny_model_dir: str) -> list[list[int]]:
    llm = make_llm(model=tiny_model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, raw_prompt=True)]


def test_min_tokens_equals_the_reference_with_every_drafter(
        make_llm: Any, tiny_model_dir: str, tiny_drafters: dict,
        plain_outputs: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    m = 9
    params, want = [], []
    for prompt, plain in zip(PROMPTS, plain_outputs, strict=True):
        # a stop id the plain output has early (without min_tokens it ends there), and the
        # token the banned output has at position m, where the ban lifts: the output must
        # end exactly there (a tree row past m banned too would go on)
        early = plain[2]
        late = _hf_greedy(tiny_model_dir, tokenizer, prompt, {early}, m)[m]
        stop = {early, late}
        for min_tokens in (0, m):
            params.append(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                         stop_token_ids=tuple(stop), min_tokens=min_tokens))
            want.append(_hf_greedy(tiny_model_dir, tokenizer, prompt, stop, min_tokens))
        assert want[-2] == plain[:3] and len(want[-1]) == m + 1 and want[-1][-1] == late
    prompts = [p for p in PROMPTS for _ in range(2)]
    self_draft = dict(speculative_algorithm="draft_model", draft_model=tiny_model_dir,
                      num_draft_tokens=5, speculative_depth=3, speculative_topk=2)
    for name, opts in {"none": {}, "self_draft": self_draft, "ngram": tiny_drafters["ngram"],
                       "eagle": tiny_drafters["eagle"]}.items():
        outs = make_llm(model=tiny_model_dir, **opts).generate(prompts, params, raw_prompt=True)
        assert [o.token_ids for o in outs] == want, name
        if name == "self_draft":  # trees whose rows cross min_tokens were verified
            assert sum(o.spec.draft_tokens_accepted for o in outs) > 0


def test_no_stop_string_inside_the_first_min_tokens(make_llm: Any, tiny_model_dir: str,
                                                     plain_outputs: list[list[int]]) -> None:
    """A stop string that the text of the first ``min_tokens`` tokens completes does not
    count; the first one completed later cuts the text there (the ids are the plain ones:
    stop strings do not change the logits)."""
    from transformers import AutoTokenizer

    from structspec.stop_strings import first_stop_ending_after

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    llm = make_llm(model=tiny_model_dir)
    plain = plain_outputs[0]
    text = tokenizer.decode(plain)
    m = 6
    head = tokenizer.decode(plain[:m])
    # the last two characters of the first min_tokens tokens' text, and a character that
    # occurs both there and later: both would cut inside the head without min_tokens
    stops = sorted({head[-2:], *(c for c in head if c in text[len(head):] and c.strip())})
    assert stops
    hit = first_stop_ending_after(text, stops, len(head))
    for min_tokens in (0, m):
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      stop=tuple(stops), min_tokens=min_tokens),
                           raw_prompt=True)[0]
        assert text.startswith(out.text)
        if min_tokens == 0:
            assert len(out.text) < len(head)
        elif hit is None:
            assert out.text == text and out.finish_reason == "length"
        else:
            assert out.text == text[:hit[0]] and out.stop_reason == hit[1]


def test_a_complete_grammar_still_ends_the_request(make_llm: Any, tiny_model_dir: str) -> None:
    """Where the grammar allows nothing but a stop token, ``min_tokens`` does not ban it: the
    request ends as without it (no row is left without a token)."""
    llm = make_llm(model=tiny_model_dir)
    grammar = ChoiceConstraint(["yes", "no"])
    outs = [llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, grammar=grammar,
                                                   min_tokens=m), raw_prompt=True)[0]
            for m in (0, 12)]
    assert outs[0].text in ("yes", "no") and outs[0].finish_reason == "stop"
    assert (outs[1].text, outs[1].token_ids, outs[1].finish_reason, outs[1].error) == (
        outs[0].text, outs[0].token_ids, "stop", None)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be in"),
    (dict(min_tokens=-1), "min_tokens must be in"),
    (dict(min_tokens=2.0), "min_tokens must be an integer"),
    (dict(min_tokens=True), "min_tokens must be an integer"),
])
def test_bad_min_tokens_is_an_error_naming_it(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate()
