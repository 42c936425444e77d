"""The engine on CUDA: no host syncs in decode/verify steps, and spec-on equals spec-off
except at bf16 near-ties (counted, with their logit gap)."""

from __future__ import annotations

import pytest
import torch

from structspec import JsonSchemaSpec, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_llms():
    from structspec import LLM

    llms = {algo: LLM(device="cuda", speculative_algorithm=algo, num_draft_tokens=8,
                      max_batch_size=16) for algo in ("none", "ngram")}
    yield llms
    for llm in llms.values():
        llm.close()


def test_decode_steps_do_not_sync(cuda_llms) -> None:
    engine = cuda_llms["ngram"].engine
    for i, p in enumerate(PROMPTS[:6]):
        grammar = JsonSchemaSpec(PERSON_SCHEMA) if i % 2 else None
        engine.add_request(p, SamplingParams(max_tokens=40, grammar=grammar))
    # Prefill steps (and grammar compiles) first; then only verify steps remain.
    while engine.scheduler.waiting or engine.scheduler.grammar_queue:
        engine.step()
    engine.step()  # first verify step: CUDA graph capture happens outside the check
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished_requests() and steps < 30:
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert steps > 3


def test_spec_matches_plain_up_to_near_ties(cuda_llms) -> None:
    params = SamplingParams(max_tokens=48)
    plain = cuda_llms["none"].generate(PROMPTS, params)
    spec = cuda_llms["ngram"].generate(PROMPTS, params)
    diverged = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True))
                if a.token_ids != b.token_ids]
    print(f"bf16 spec-vs-plain divergences: {len(diverged)}/{len(PROMPTS)}")
    # Divergence is allowed only at near-ties: check the top-2 gap of the plain run's logits
    # at the first differing position (recomputed with logprobs).
    for i in diverged:
        a, b = plain[i].token_ids, spec[i].token_ids
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        lp = cuda_llms["none"].generate(PROMPTS[i], SamplingParams(max_tokens=j + 1,
                                                                    logprobs=2))[0]
        top = lp.logprobs[j].top_logprobs
        gap = top[0][1] - top[1][1]
        print(f"prompt {i}: diverged at token {j}, top-2 logprob gap {gap:.4f}")
        # bf16 kernels for an 8-row tree and a 1-row decode round differently (the skinny
        # GEMM of kernels/gemv.py reduces a 1-row product on CUDA cores and an 8-row one on
        # tensor cores). Measured on the H200: 8/22 prompts diverge, every one at a gap of 0
        # or 0.125 = one bf16 step of a logit in [16, 32): equal or adjacent bf16 logits.
        # With STRUCTSPEC_GEMV=0 (cuBLAS for both): 0/22.
        assert gap <= 0.125 + 1e-6
    assert len(diverged) <= len(PROMPTS) // 2
