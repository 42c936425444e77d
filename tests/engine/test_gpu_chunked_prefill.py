"""Chunked prefill on CUDA with the default model: chunks run through the GPU attention path
(the prefill mask built on the device) and EAGLE's features arrive chunk by chunk. Greedy
output with a 64-token budget equals the unchunked output (float32, so no bf16 near-tie can
flip a token), with prefix caching, for every drafter that needs no extra weights, under a
JSON Schema; no page leaks."""

from __future__ import annotations

import pytest
import torch

from structspec import JsonSchemaConstraint, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA
from tests.engine.test_chunked_prefill import unchunked
from tests.engine.test_prefix_cache import QUESTIONS, SYSTEM, assert_no_leak

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("algo", ["none", "ngram", "eagle"])
def test_chunked_equals_unchunked_on_cuda(algo: str) -> None:
    from structspec import LLM

    kw = {} if algo == "none" else dict(num_draft_tokens=8)
    llm = LLM(device="cuda", dtype="float32", speculative_algorithm=algo, max_batch_size=8,
              max_num_batched_tokens=64, **kw)
    try:
        prompts = [SYSTEM * 4 + q for q in QUESTIONS]
        params = [SamplingParams(max_tokens=48, temperature=0.0,
                                 grammar=JsonSchemaConstraint(PERSON_SCHEMA)),
                  SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 2
        with unchunked(llm, prefix_cache=False):
            want = llm.generate(prompts, params, raw_prompt=True)
        got = llm.generate(prompts, params, raw_prompt=True)  # chunks, then cache hits
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert all(o.error is None for o in got)
        assert any(o.cached_tokens > 0 for o in got)
        assert_no_leak(llm)
    finally:
        llm.engine.close()
