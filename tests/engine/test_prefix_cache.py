"""Prefix caching in the engine (issue 21): greedy output is the same with the cache on and
off (plain, JSON Schema, every drafter), shared prompts report cached tokens, eviction under a
small KV pool keeps outputs right and never takes a referenced page, no page leaks, and the
cached pages hold exactly the prompt's KV (no drafted token's KV ever lands in one).

All on the 2-layer random tiny Llama (``tiny_model_dir``): fast, with peaked logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structspec import SamplingParams
from structspec.constraints import JsonSchemaConstraint

from .conftest import PERSON_SCHEMA, feature_drafters

SYSTEM = ("You are a careful assistant for a shop. Answer in one short line, use plain words, "
          "never invent prices, and ask for the order number when it is missing. ") * 2
QUESTIONS = ["Where is my parcel?", "Can I return shoes?", "Do you ship to Spain?",
             "What is your phone number?"]
# two more system prompts: chains of their own, so a small pool must evict cached pages
SYSTEM_B = ("Reply as a pirate who loves maps and weather reports, in one sentence, "
            "always mentioning the sea and a compass. ") * 2
SYSTEM_C = ("Translate every answer into formal French, keep numbers as digits, and end "
            "each reply with a polite greeting to the customer. ") * 2


def _params() -> list[SamplingParams]:
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_tokens=24, temperature=0.0,
                            grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    return [plain, schema, plain, schema]


def generate_without_cache(llm: Any, prompts: list[str],
                           params: list[SamplingParams]) -> list[Any]:
    """``llm.generate`` with its prefix cache switched off for the call (one engine serves
    both runs: half the engine builds of a second, cache-off engine)."""
    alloc = llm.engine.scheduler.allocator
    was, alloc.enabled = alloc.enabled, False
    try:
        return llm.generate(prompts, params, raw_prompt=True)
    finally:
        alloc.enabled = was


def assert_no_leak(llm: Any) -> None:
    """After every request finished: each page is free or an evictable cached page."""
    s = llm.engine.scheduler
    alloc = s.allocator
    assert not s.running and not s.waiting
    assert alloc.num_free_pages == alloc.num_pages - 1
    assert alloc.num_evictable_pages == alloc.num_cached_pages


def assert_cached_kv_is_prompt_kv(llm: Any, prompt_ids: list[int]) -> None:
    """The KV in the cached pages of ``prompt_ids`` equals a fresh prefill's of that prefix."""
    s = llm.engine.scheduler
    alloc, runner, ps = s.allocator, s.runner, s.allocator.page_size
    hits = alloc.match(prompt_ids)
    assert hits, "the prompt should be cached"
    alloc.acquire(hits)  # no allocation below may evict them
    fresh = alloc.allocate(len(hits))
    try:
        runner.prefill([prompt_ids[: len(hits) * ps]], [fresh])
        kv = runner.kv_pool.kv_buffer
        slots = lambda pages: torch.tensor([p * ps + i for p in pages for i in range(ps)])  # noqa: E731
        torch.testing.assert_close(kv[:, :, slots(hits)], kv[:, :, slots(fresh)],
                                   rtol=1e-4, atol=1e-5)
    finally:
        alloc.free(fresh)
        alloc.free(hits)


@pytest.mark.parametrize("drafter", feature_drafters())
def test_greedy_same_with_and_without_prefix_cache(make_llm, tiny_model_dir: str,
                                                   tiny_drafters: dict, drafter: str) -> None:
    kw = dict(model=tiny_model_dir, **tiny_drafters[drafter])
    on = make_llm(**kw)
    prompts = [SYSTEM + q for q in QUESTIONS]
    if drafter == "none":  # the config flag itself, on an engine of its own
        off = make_llm(enable_prefix_caching=False, **kw)
        assert not off.engine.scheduler.allocator.enabled
        want = off.generate(prompts, _params(), raw_prompt=True)
    else:
        want = generate_without_cache(on, prompts, _params())
    on.generate([SYSTEM + "Hello?"], SamplingParams(max_tokens=2, temperature=0.0),
                raw_prompt=True)  # the system prompt's pages are cached now
    got = on.generate(prompts, _params(), raw_prompt=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.error is None for o in got)
    assert all(o.cached_tokens == 0 for o in want)
    ps = on.engine.scheduler.allocator.page_size
    assert all(o.cached_tokens >= ps and o.cached_tokens % ps == 0 for o in got)
    assert all(o.cached_tokens < len(o.prompt_token_ids) for o in got)
    for o in got:
        assert_cached_kv_is_prompt_kv(on, o.prompt_token_ids)
    if drafter == "eagle":  # the cached positions' features came from the feature store
        assert on.engine.scheduler.runner.prompt_features is not None
        assert sum(o.spec.draft_tokens_proposed for o in got) > 0
    assert_no_leak(on)
    stats = on.engine.stats()
    assert 0.0 < stats["prefix_cache_hit_rate"] <= 1.0


def test_eviction_under_a_small_pool(make_llm, tiny_model_dir: str, tiny_drafters: dict) -> None:
    """Three system prompts through a pool that holds two requests: cached pages are
    evicted (LRU) to admit new ones, outputs stay those of the cache-off engine, and at every
    step each cached page's reference count is the number of running requests holding it."""
    on = make_llm(model=tiny_model_dir, kv_capacity_tokens=160, max_batch_size=4,
                  **tiny_drafters["draft_model"])
    prompts = [sp + q for q in QUESTIONS[:2] for sp in (SYSTEM, SYSTEM_B, SYSTEM_C)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(prompts)
    want = generate_without_cache(on, prompts, params)
    engine = on.engine
    alloc = engine.scheduler.allocator
    evicted_before = alloc.stats.evicted_pages
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(p, sp, request_id=f"evict-{i}", raw_prompt=True)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        holders: dict[int, int] = {}
        for r in engine.scheduler.running:
            assert len(set(r.pages)) == len(r.pages)
            for page in r.pages:
                holders[page] = holders.get(page, 0) + 1
        for page, n in holders.items():
            if alloc.ref_count(page) == 0:
                assert n == 1, f"uncached page {page} held by {n} requests"
            else:
                assert alloc.ref_count(page) == n and not alloc.is_evictable(page)
    got = [done[f"evict-{i}"] for i in range(len(prompts))]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert alloc.stats.evicted_pages > evicted_before
    assert any(o.cached_tokens > 0 for o in got)
    assert_no_leak(on)
