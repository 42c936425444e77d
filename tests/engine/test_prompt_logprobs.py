"""``prompt_logprobs`` (vLLM's): every prompt token's logprob, rank and top-k under the
target model, computed in the prefill, equal to a plain Hugging Face float32 forward over the
whole prompt. Checked with chunked prefill splitting the prompt (chunk boundaries covered),
beside requests that do not ask (their outputs unchanged), over a prefix cache that holds the
prompt's prefix (bypassed: every position computed), with n-gram speculation (the generated
output unchanged) and across preemption (nothing duplicated or lost).

All on the 2-layer random tiny Llama (``tiny_model_dir``): fast, with peaked logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structspec import SamplingParams
from structspec.core import TokenLogprob

from .test_prefix_cache import QUESTIONS, SYSTEM

K = 4
BUDGET = 16  # chunk budget: the long prompt below takes ~10 chunks
TOL = 1e-3  # float32 engine against float32 Hugging Face: ~1e-5 apart; logits here are ~100


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir: str) -> Any:
    """``ids -> [len(ids) - 1, V]`` float32 log-softmax of a Hugging Face forward over the
    whole prompt (row ``p`` predicts token ``p + 1``)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir,
                                             torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        return logits.log_softmax(dim=-1)

    return run


def assert_matches_reference(got: list[TokenLogprob | None] | None, ids: list[int],
                             ref: torch.Tensor, k: int) -> None:
    """Each position's logprob, rank and top-k equal the reference's (top-k ids compared
    where the next value is apart: near-ties may list either token)."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry, row = got[p], ref[p - 1]
        assert entry is not None and entry.token_id == ids[p]
        want = float(row[ids[p]])
        assert abs(entry.logprob - want) < TOL, p
        assert entry.rank is not None
        assert int((row > want + TOL).sum()) + 1 <= entry.rank <= int((row > want - TOL).sum()) + 1
        top = row.topk(k + 1)
        assert len(entry.top_logprobs) == k
        for j, (tok, v) in enumerate(entry.top_logprobs):
            assert abs(v - float(top.values[j])) < TOL, (p, j)
            assert abs(float(row[tok]) - v) < TOL, (p, j)  # the listed id has that logprob


def test_prompt_logprobs_chunked_in_a_mixed_batch(make_llm: Any, tiny_model_dir: str,
                                                  hf_logprobs: Any) -> None:
    llm = make_llm(model=tiny_model_dir, max_num_batched_tokens=BUDGET)
    prompts = [SYSTEM + QUESTIONS[0], QUESTIONS[1], SYSTEM + QUESTIONS[2]]
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    asking = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=K)
    want = llm.generate(prompts, plain, raw_prompt=True)
    got = llm.generate(prompts, [plain, asking, asking], raw_prompt=True)
    # only the asking requests get them; nobody's output changes
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].prompt_logprobs is None
    for out in got[1:]:
        ids = out.prompt_token_ids
        assert len(ids) > 3 * BUDGET or out is got[1]  # the long one takes several chunks
        assert_matches_reference(out.prompt_logprobs, ids, hf_logprobs(ids), K)
        assert out.cached_tokens == 0  # the first run cached SYSTEM's pages: bypassed


def test_prefix_cache_is_bypassed(make_llm: Any, tiny_model_dir: str,
                                  hf_logprobs: Any) -> None:
    """A cached shared prefix serves a plain request, never one asking prompt logprobs."""
    llm = make_llm(model=tiny_model_dir)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([SYSTEM + QUESTIONS[3]], plain, raw_prompt=True)  # caches SYSTEM's pages
    hit, asked = llm.generate([SYSTEM + QUESTIONS[1], SYSTEM + QUESTIONS[2]],
                              [plain, SamplingParams(max_tokens=4, ignore_eos=True,
                                                     prompt_logprobs=0)], raw_prompt=True)
    assert hit.cached_tokens > 0 and asked.cached_tokens == 0
    ids = asked.prompt_token_ids
    assert_matches_reference(asked.prompt_logprobs, ids, hf_logprobs(ids), 0)
    again = llm.generate([SYSTEM + QUESTIONS[2]], plain, raw_prompt=True)[0]
    assert again.cached_tokens > 0 and again.token_ids == asked.token_ids


def test_speculation_leaves_the_output_unchanged(make_llm: Any, tiny_model_dir: str,
                                                 tiny_drafters: dict) -> None:
    prompts = [SYSTEM + QUESTIONS[0], "Hi"]
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    asking = SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=K, logprobs=2)
    want = make_llm(model=tiny_model_dir).generate(prompts, [plain, asking], raw_prompt=True)
    got = make_llm(model=tiny_model_dir, **tiny_drafters["ngram"]).generate(
        prompts, [asking, asking], raw_prompt=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
    assert got[0].logprobs is not None and len(got[0].logprobs) == len(got[0].token_ids)


def test_one_token_prompt(make_llm: Any, tiny_model_dir: str) -> None:
    out = make_llm(model=tiny_model_dir).generate(
        ["Hi"], SamplingParams(max_tokens=2, prompt_logprobs=3), raw_prompt=True)[0]
    assert len(out.prompt_token_ids) == 1 and out.prompt_logprobs == [None]


def test_preemption_keeps_prompt_logprobs_once(make_llm: Any, tiny_model_dir: str) -> None:
    """Through a pool ~3x oversubscribed, each request's prompt logprobs come once, whole,
    equal to the big pool's, and every streamed output carries the same list."""
    from .conftest import PROMPTS
    from .test_preemption import SMALL_KV_TOKENS, _run_streaming

    prompts = PROMPTS[:6]
    params = [SamplingParams(max_tokens=32, ignore_eos=True, prompt_logprobs=2)] * 6
    want = make_llm(model=tiny_model_dir).generate(prompts, params, raw_prompt=True)
    small = make_llm(model=tiny_model_dir, kv_capacity_tokens=SMALL_KV_TOKENS)
    before = small.engine.stats()["num_preemptions"]
    got, _ = _run_streaming(small, prompts, params)
    assert small.engine.stats()["num_preemptions"] > before
    for g, w in zip(got.values(), want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids)
        assert [e and (e.token_id, e.rank) for e in g.prompt_logprobs] == \
            [e and (e.token_id, e.rank) for e in w.prompt_logprobs]


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_values_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()
