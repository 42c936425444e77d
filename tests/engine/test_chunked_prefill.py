"""Chunked prefill (issue 21): greedy output is the same with chunking on (a 16-token budget,
so every prompt takes several chunks) and off, for every drafter with a JSON Schema and with
prefix caching; a long prompt arriving while others decode is prefilled between their verify
steps, which go on emitting tokens, unchanged; its grammar and its first token wait for its
last chunk; the grammar advance and stop handling are those of the unchunked run; an abort
mid-prefill frees everything; bad budgets are refused naming the field.

All on the 2-layer random tiny Llama (``tiny_model_dir``): fast, with peaked logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from structspec import FinishReason, SamplingParams
from structspec.config import EngineConfig, SchedulerConfig, resolve_engine_config
from structspec.constraints import JsonSchemaConstraint
from structspec.scheduler.chunked_prefill import ChunkBudget, PrefillChunk

from .conftest import PERSON_SCHEMA, feature_drafters
from .test_prefix_cache import QUESTIONS, SYSTEM, assert_no_leak

BUDGET = 16  # tokens per chunk: the prompts below take 4 to 25 chunks
LONG = SYSTEM * 3 + "Now answer as JSON."  # ~300 tokens (the tiny model holds 512)


def chunked_llm(make_llm: Any, **kw: Any) -> Any:
    return make_llm(max_num_batched_tokens=BUDGET, **kw)


@contextlib.contextmanager
def unchunked(llm: Any, *, prefix_cache: bool = True) -> Iterator[None]:
    """Chunking (and optionally prefix caching) off for the block, on the same engine (one
    engine serves both runs: half the engine builds)."""
    s = llm.engine.scheduler
    was = s.chunks.enabled, s.allocator.enabled
    s.chunks.enabled, s.allocator.enabled = False, prefix_cache and was[1]
    try:
        yield
    finally:
        s.chunks.enabled, s.allocator.enabled = was


@contextlib.contextmanager
def no_prefix_cache(llm: Any) -> Iterator[None]:
    alloc = llm.engine.scheduler.allocator
    was, alloc.enabled = alloc.enabled, False
    try:
        yield
    finally:
        alloc.enabled = was


def record_chunks(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[PrefillChunk]]:
    """Every prefill step's chunks from now on (the scheduler's ``after_forward`` spied)."""
    chunks = llm.engine.scheduler.chunks
    seen: list[list[PrefillChunk]] = []
    real = chunks.after_forward

    def spy(step_chunks: list[PrefillChunk]) -> list:
        seen.append(list(step_chunks))
        return real(step_chunks)

    monkeypatch.setattr(chunks, "after_forward", spy)
    return seen


def _params() -> list[SamplingParams]:
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_tokens=24, temperature=0.0,
                            grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    return [plain, schema, plain, schema]


@pytest.mark.parametrize("drafter", feature_drafters())
def test_greedy_same_with_and_without_chunking(make_llm, tiny_model_dir: str,
                                              tiny_drafters: dict, drafter: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    llm = chunked_llm(make_llm, model=tiny_model_dir, **tiny_drafters[drafter])
    prompts = [SYSTEM + q for q in QUESTIONS]
    with unchunked(llm, prefix_cache=False):
        want = llm.generate(prompts, _params(), raw_prompt=True)
    seen = record_chunks(llm, monkeypatch)
    with no_prefix_cache(llm):  # every chunk computed: EAGLE features from each forward
        got = llm.generate(prompts, _params(), raw_prompt=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert all(o.error is None for o in got)
    assert all(sum(c.end - c.start for c in step) <= BUDGET for step in seen)
    per_request = {c.req.request_id for step in seen for c in step if not c.first}
    assert len(per_request) == len(prompts)  # every prompt took more than one chunk
    # prefix caching beside chunks: first chunks start over cached pages (EAGLE: the
    # cached positions' features come from the feature store)
    llm.generate([SYSTEM + "Hello?"], SamplingParams(max_tokens=2, temperature=0.0),
                 raw_prompt=True)  # the system prompt's pages are cached now
    seen.clear()
    got = llm.generate(prompts, _params(), raw_prompt=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.cached_tokens > 0 for o in got)
    assert any(c.first and c.start > 0 for step in seen for c in step)
    if drafter != "none":
        assert sum(o.spec.draft_tokens_proposed for o in got) > 0
    assert_no_leak(llm)


def test_long_prompt_arrives_while_others_decode(make_llm, tiny_model_dir: str) -> None:
    """Two streams decode; a long constrained prompt arrives. Each of its chunks rides in a
    step with the streams' verify forward (the streams gain tokens in every chunk's step),
    its matcher and output stay untouched until its last chunk, and every output equals the
    unchunked run's."""
    llm = chunked_llm(make_llm, model=tiny_model_dir)
    engine, sched = llm.engine, llm.engine.scheduler
    short = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=16, temperature=0.0,
                                 grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    with unchunked(llm, prefix_cache=False):
        want = llm.generate([QUESTIONS[0], QUESTIONS[1], LONG], [short, short, long_params],
                            raw_prompt=True)
    with no_prefix_cache(llm):
        streams = [engine.add_request(q, short, raw_prompt=True) for q in QUESTIONS[:2]]
        counts = dict.fromkeys(streams, 0)
        done: dict[str, Any] = {}

        def step() -> None:
            for out in engine.step():
                counts[out.request_id] = len(out.token_ids)
                if out.finished:
                    done[out.request_id] = out

        while not all(counts.values()):
            step()
        long_id = engine.add_request(LONG, long_params, raw_prompt=True)
        chunk_steps = 0
        gains: list[int] = []  # the streams' new tokens per step until the long one's first
        while long_id not in counts:
            before = sum(counts.values())
            step()
            long_req = sched.requests[long_id]
            if sched.chunks.prefilling:
                assert sched.chunks.prefilling == [long_req]
                chunk_steps += 1
                assert long_req.output_ids == [] and long_req.first_token_time is None
                assert long_req.matcher is not None
                assert long_req.matcher.num_accepted == 0 == long_req.num_grammar_advanced
            if long_req.seq_len:  # admitted (its grammar compiled): its prefill started
                gains.append(sum(counts.values()) - before)
        # the streams were decoding all along (none finished before the long prompt's
        # first token), and every chunk's step was also a verify step of theirs
        assert not done and max(counts[r] for r in streams) < short.max_tokens
        num_chunks = -(-len(sched.requests[long_id].prompt_ids) // BUDGET)
        assert num_chunks > 10 and chunk_steps >= num_chunks - 1
        assert len(gains) <= num_chunks + 1
        assert sum(1 for g in gains if g > 0) >= num_chunks - 1
        while engine.has_unfinished_requests():
            step()
    got = [done[r] for r in (*streams, long_id)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert_no_leak(llm)


def test_grammar_advance_and_stops_same_as_unchunked(make_llm, tiny_model_dir: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Matcher advances (tokens accepted, counted) and stop handling across chunks equal the
    unchunked run's: a stop token id hit by the first token (committed right after the last
    chunk), max_tokens, and constrained requests with stop strings."""
    from structspec.grammar.matcher import Matcher

    llm = chunked_llm(make_llm, model=tiny_model_dir, speculative_algorithm="ngram",
                      num_draft_tokens=6)
    accepted = [0]
    real_accept = Matcher.accept_run

    def counting_accept_run(self: Matcher, token_ids: list[int]) -> int:
        accepted[0] += len(token_ids)
        return real_accept(self, token_ids)

    monkeypatch.setattr(Matcher, "accept_run", counting_accept_run)
    schema = JsonSchemaConstraint(PERSON_SCHEMA)
    prompts = [LONG, SYSTEM + QUESTIONS[2], LONG + " Again."]
    with unchunked(llm, prefix_cache=False):
        first = llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0),
                             raw_prompt=True)[0].token_ids[0]
    params = [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first]),
              SamplingParams(max_tokens=30, temperature=0.0, grammar=schema, stop=['",']),
              SamplingParams(max_tokens=5, temperature=0.0, grammar=schema)]
    runs = []
    for chunked in (False, True):
        accepted[0] = 0
        with no_prefix_cache(llm), (contextlib.nullcontext() if chunked else unchunked(llm)):
            outs = llm.generate(prompts, params, raw_prompt=True)
        runs.append((accepted[0], [(o.token_ids, o.text, o.finish_reason, o.stop_reason)
                                   for o in outs]))
    assert runs[0] == runs[1]
    outs_first = runs[1][1][0]
    assert outs_first[0] == [first] and outs_first[2] is FinishReason.STOP
    assert runs[1][1][2][2] is FinishReason.LENGTH and len(runs[1][1][2][0]) == 5
    assert runs[1][0] > 0
    assert_no_leak(llm)


def test_abort_mid_prefill_frees_everything(make_llm, tiny_model_dir: str) -> None:
    llm = chunked_llm(make_llm, model=tiny_model_dir)
    engine, sched = llm.engine, llm.engine.scheduler
    # a cold prefill: the shared engine may hold LONG's prefix from an earlier test (its first
    # step then starts past the cached pages)
    with no_prefix_cache(llm):
        rid = engine.add_request(LONG, SamplingParams(max_tokens=4), raw_prompt=True)
        engine.step()
        assert sched.chunks.prefilling and sched.requests[rid].seq_len == BUDGET
        assert engine.stats()["num_prefilling"] == 1 and engine.stats()["num_running"] == 0
        assert engine.abort_request(rid)
        outs = [o for _ in range(2) for o in engine.step()]
    assert [o.finish_reason for o in outs if o.request_id == rid] == [FinishReason.ABORT]
    assert not sched.chunks.prefilling and not engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_budget_grants() -> None:
    """The first request of a step may get a partial chunk; later ones must fit whole within
    ``rows x longest chunk <= budget``."""
    b = ChunkBudget(100)
    assert b.grant(500) == 100
    b = ChunkBudget(100)
    assert b.grant(20) == 20
    b.take(20)
    assert b.grant(30) == 30
    b.take(30)
    assert b.grant(34) == 0  # 3 rows x 34 > 100
    assert b.grant(33) == 33 and b.grants == [20, 30]


@pytest.mark.parametrize("value,match", [
    (0, "max_num_batched_tokens=0: expected an integer >= 1"),
    (-5, "max_num_batched_tokens=-5"),
    ("512", "max_num_batched_tokens='512': expected an integer"),
    (2.5, "max_num_batched_tokens=2.5: expected an integer"),
])
def test_bad_budget_is_refused_naming_the_field(value: object, match: str) -> None:
    config = EngineConfig(device="cpu", scheduler=SchedulerConfig(
        max_num_batched_tokens=value))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        resolve_engine_config(config)


def test_budget_auto_flag_and_switch() -> None:
    from structspec.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from structspec.engine_args import flag_error

    resolved = resolve_engine_config(EngineConfig(device="cpu")).scheduler
    assert resolved.enable_chunked_prefill
    assert resolved.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    with pytest.raises(ValueError, match="enable_chunked_prefill='no'") as e:
        resolve_engine_config(EngineConfig(device="cpu", scheduler=SchedulerConfig(
            enable_chunked_prefill="no")))  # type: ignore[arg-type]
    assert flag_error(str(e.value)).startswith("--no-chunked-prefill: ")
    assert flag_error("max_num_batched_tokens=0: x").startswith("--max-num-batched-tokens: ")
