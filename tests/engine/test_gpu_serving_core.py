"""The serving core on CUDA with the default model, float32 (so no bf16 near-tie can flip a
token), for every drafter that needs no extra weights, under a JSON Schema:

* prefix caching: prefill over cached KV runs through the GPU attention path and the EAGLE
  feature store lives on the device; greedy output with the cache on equals it off;
* chunked prefill (64-token budget): chunks replay prefill graphs (none, ngram: logits
  only; EAGLE: the feature graphs, its features arriving chunk by chunk); greedy output
  equals the unchunked output.

Cached tokens are reported and no page leaks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from structspec import JsonSchemaConstraint, SamplingParams
from tests.engine.conftest import PERSON_SCHEMA
from tests.engine.test_chunked_prefill import unchunked
from tests.engine.test_prefix_cache import (
    QUESTIONS,
    SYSTEM,
    assert_no_leak,
    generate_without_cache,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALGOS = ["none", "ngram", "eagle"]
PROMPTS = [SYSTEM * 4 + q for q in QUESTIONS]
# the chunked test runs on the prefix test's engine: prompts none of whose pages it cached
CHUNK_PROMPTS = ["(chunked) " + p for p in PROMPTS]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=48, temperature=0.0,
                           grammar=JsonSchemaConstraint(PERSON_SCHEMA)),
            SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 2


def _cuda_llm(algo: str, **kw: Any) -> Any:
    from structspec import LLM

    if algo != "none":
        kw["num_draft_tokens"] = 8
    return LLM(device="cuda", dtype="float32", speculative_algorithm=algo, max_batch_size=8,
               **kw)


@pytest.fixture(scope="module")
def cuda_llm() -> Iterator[Callable[[str], Any]]:
    """One engine per drafter for both tests (an engine build with its CUDA graphs is most of
    a test's time; the chunked test sets its 64-token budget on the same scheduler)."""
    built: dict[str, Any] = {}

    def get(algo: str) -> Any:
        if algo not in built:
            built[algo] = _cuda_llm(algo)
        return built[algo]

    yield get
    for llm in built.values():
        llm.close()


@pytest.mark.parametrize("algo", ALGOS)
def test_prefix_cache_on_equals_off_on_cuda(cuda_llm: Callable[[str], Any], algo: str) -> None:
    llm = cuda_llm(algo)
    want = generate_without_cache(llm, PROMPTS, _params())
    llm.generate([SYSTEM * 4 + "Hello?"], SamplingParams(max_tokens=2, temperature=0.0),
                 raw_prompt=True)
    got = llm.generate(PROMPTS, _params(), raw_prompt=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.error is None for o in got)
    assert all(o.cached_tokens > 0 for o in got)
    if algo == "eagle":
        assert sum(o.spec.draft_tokens_accepted for o in got) > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("algo", ALGOS)
def test_chunked_equals_unchunked_on_cuda(cuda_llm: Callable[[str], Any], algo: str) -> None:
    llm = cuda_llm(algo)
    chunks = llm.engine.scheduler.chunks
    was = chunks.budget_tokens
    chunks.budget_tokens = 64
    try:
        with unchunked(llm, prefix_cache=False):
            want = llm.generate(CHUNK_PROMPTS, _params(), raw_prompt=True)
        cache = llm.engine.runner.prefill_graphs
        replayed: list[tuple[int, ...] | None] = []  # each chunk's graph variant (aux layers)
        run = cache.run

        def recording_run(*args: Any, **kwargs: Any) -> Any:
            replayed.append(args[4] if len(args) > 4 else kwargs.get("aux_hidden_layers"))
            return run(*args, **kwargs)

        cache.run = recording_run
        try:
            got = llm.generate(CHUNK_PROMPTS, _params(), raw_prompt=True)  # chunks, then hits
        finally:
            del cache.run
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert all(o.error is None for o in got)
        assert any(o.cached_tokens > 0 for o in got)
        # the chunks replay prefill graphs: logits only, or EAGLE's feature variant
        assert replayed, algo
        assert all((aux is not None) == (algo == "eagle") for aux in replayed), replayed
        assert_no_leak(llm)
    finally:
        chunks.budget_tokens = was
