"""Offline log-probabilities: after the grammar mask, forbidden tokens never listed."""

from __future__ import annotations

import math

from structspec import JsonSchemaConstraint, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS


def test_logprobs_with_and_without_grammar(make_llm) -> None:
    llm = make_llm(speculative_algorithm="ngram", num_draft_tokens=8)
    free, constrained = llm.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=12, logprobs=5),
        SamplingParams(max_tokens=40, logprobs=5, grammar=JsonSchemaConstraint(PERSON_SCHEMA)),
    ])
    for out in (free, constrained):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert lp.token_id == tok and math.isfinite(lp.logprob)
            assert all(math.isfinite(v) for _, v in lp.top_logprobs)
            # greedy: the emitted token is the most likely allowed one
            assert lp.top_logprobs[0][0] == tok
            assert abs(lp.top_logprobs[0][1] - lp.logprob) < 1e-5
    assert all(len(lp.top_logprobs) == 5 for lp in free.logprobs)
    # JSON punctuation positions allow a single token: their lists are shorter than 5
    assert any(len(lp.top_logprobs) < 5 for lp in constrained.logprobs)
