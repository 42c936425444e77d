"""Prefix caching on CUDA with the default model: prefill over cached KV runs through the GPU
attention path and the EAGLE feature store lives on the device. Greedy output with the cache on
equals the output with it off (float32, so no bf16 near-tie can flip a token), for every
drafter that needs no extra weights, under a JSON Schema; cached tokens are reported and no page
leaks."""

from __future__ import annotations

import pytest
import torch

from structspec import JsonSchemaConstraint, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA
from tests.engine.test_prefix_cache import (
    QUESTIONS,
    SYSTEM,
    assert_no_leak,
    generate_without_cache,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("algo", ["none", "ngram", "eagle"])
def test_prefix_cache_on_equals_off_on_cuda(algo: str) -> None:
    from structspec import LLM

    kw = {} if algo == "none" else dict(num_draft_tokens=8)
    llm = LLM(device="cuda", dtype="float32", speculative_algorithm=algo, max_batch_size=8,
              **kw)
    try:
        prompts = [SYSTEM * 4 + q for q in QUESTIONS]
        params = [SamplingParams(max_tokens=48, temperature=0.0,
                                 grammar=JsonSchemaConstraint(PERSON_SCHEMA)),
                  SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 2
        want = generate_without_cache(llm, prompts, params)
        llm.generate([SYSTEM * 4 + "Hello?"], SamplingParams(max_tokens=2, temperature=0.0),
                     raw_prompt=True)
        got = llm.generate(prompts, params, raw_prompt=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert all(o.error is None for o in got)
        assert all(o.cached_tokens > 0 for o in got)
        if algo == "eagle":
            assert sum(o.spec.draft_tokens_accepted for o in got) > 0
        assert_no_leak(llm)
    finally:
        llm.close()
