"""KV allocation on demand, preemption and priority (issue 21, items 3 and 4).

A KV pool about 3x oversubscribed (requests whose ``max_tokens`` together need ~3x the
pool): every request completes, greedy outputs equal those of an engine with enough KV,
preemptions happen and are counted, and afterwards every page is free or an evictable
prefix-cache page; with a JSON Schema grammar and with each drafter. Across preemption the
grammar matcher advances exactly once per committed token, stop strings cut where they did,
and streamed deltas add up to the final output (nothing emitted twice). Priority orders
admission and preemption.

All on the 2-layer random tiny Llama (``tiny_model_dir``): fast, with peaked logits.
"""

from __future__ import annotations

from typing import Any

import pytest

from structspec import SamplingParams
from structspec.constraints import JsonSchemaConstraint
from structspec.core import RequestError

from .conftest import PERSON_SCHEMA, PROMPTS, feature_drafters
from .test_prefix_cache import assert_no_leak

#: KV of the small engine: 6 pages of 16 tokens. Each request below needs up to ~65 tokens
#: alone (prompt ~10-25 + 32 new + one tree); six together ~3.5x the pool.
SMALL_KV_TOKENS = 96


def _params() -> list[SamplingParams]:
    plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_tokens=32, temperature=0.0,
                            grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    # penalties over the committed output (negative: the random model never repeats a
    # token on its own, so positive ones would change nothing): the output depends on the
    # counts, which a resume refills
    penalised = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                               frequency_penalty=-2.0, presence_penalty=-2.0)
    return [plain, schema, penalised, schema, plain, penalised]


def _run_streaming(llm: Any, prompts: list[str], params: list[SamplingParams],
                   priorities: list[int] | None = None) -> tuple[dict[str, Any], dict]:
    """Run requests through ``engine.step`` with streaming outputs; returns the final
    output and the concatenated streamed deltas (``(ids, text)``) per request id."""
    engine = llm.engine
    rids = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        prio = 0 if priorities is None else priorities[i]
        rids.append(engine.add_request(p, sp, raw_prompt=True, priority=prio))
    done: dict[str, Any] = {}
    streamed: dict[str, tuple[list[int], str]] = {r: ([], "") for r in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text = streamed[out.request_id]
            streamed[out.request_id] = (ids + list(out.new_token_ids), text + out.new_text)
            if out.finished:
                done[out.request_id] = out
    return {r: done[r] for r in rids}, streamed


@pytest.mark.parametrize("drafter", feature_drafters())
def test_oversubscribed_kv_completes_with_the_same_outputs(make_llm, tiny_model_dir: str,
                                                           tiny_drafters: dict,
                                                           drafter: str) -> None:
    kw = dict(model=tiny_model_dir, **tiny_drafters[drafter])
    prompts, params = PROMPTS[:6], _params()
    want = make_llm(**kw).generate(prompts, params, raw_prompt=True)
    small = make_llm(kv_capacity_tokens=SMALL_KV_TOKENS, **kw)
    engine = small.engine
    need = sum(engine.scheduler.kv_tokens_to_finish(r) for r in _reqs_like(small, prompts,
                                                                            params))
    assert need >= 2.5 * engine.scheduler.allocator.capacity_tokens
    before = engine.stats()["num_preemptions"]
    got, streamed = _run_streaming(small, prompts, params)
    assert [o.token_ids for o in got.values()] == [o.token_ids for o in want]
    assert [o.text for o in got.values()] == [o.text for o in want]
    assert all(o.error is None for o in got.values())
    for rid, out in got.items():  # nothing streamed twice, nothing lost
        assert streamed[rid] == (out.token_ids, out.text)
    stats = engine.stats()
    assert stats["num_preemptions"] > before
    assert stats["preemption_recomputed_tokens"] > 0
    assert_no_leak(small)


def _reqs_like(llm: Any, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    """Scheduler requests for ``prompts`` (not queued), to size what they need."""
    from structspec.scheduler.request import Req

    engine = llm.engine
    return [Req(request_id=str(i), prompt_ids=engine.tokenize_prompt(p, raw=True), params=sp,
                arrival_time=0.0, max_new_tokens=sp.max_tokens, eos_token_ids=frozenset())
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]


def test_exactly_once_grammar_advance_and_stop_strings_across_preemption(
        make_llm, tiny_model_dir: str, tiny_drafters: dict) -> None:
    """JSON Schema and stop-string requests through the oversubscribed pool (n-gram trees):
    at every step each running request's matcher has accepted exactly the ids the barrier
    advanced (the rest: at most one tree, waiting for the next barrier), each preempted one
    is caught up (matcher at its committed output); at the end every matcher has accepted
    as many ids as the request kept, and outputs and finish reasons equal the big pool's."""
    kw = dict(model=tiny_model_dir, **tiny_drafters["ngram"])
    big = make_llm(**kw)
    free = big.generate(PROMPTS[6:9], SamplingParams(max_tokens=32, temperature=0.0,
                                                     ignore_eos=True), raw_prompt=True)
    # a stop string from late in each free output: the cut falls after a preemption
    stops = [o.text[2 * len(o.text) // 3:][:4] for o in free]
    assert all(s.strip() for s in stops)
    schema = SamplingParams(max_tokens=32, temperature=0.0,
                            grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[s])
              for s in stops] + [schema] * 3
    prompts = PROMPTS[6:9] + PROMPTS[:3]
    want = big.generate(prompts, params, raw_prompt=True)
    small = make_llm(kv_capacity_tokens=SMALL_KV_TOKENS, **kw)
    engine, sched = small.engine, small.engine.scheduler
    # priority 1 (served last, preempted first) for a stop-string and a schema request
    rids = [engine.add_request(p, sp, raw_prompt=True, priority=int(i % 3 == 0))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    matchers: dict[str, Any] = {}
    preempted: set[str] = set()
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        for req in sched.running:
            if req.matcher is not None:
                matchers[req.request_id] = req.matcher
                assert req.matcher.num_accepted == req.num_grammar_advanced
                lag = len(req.output_ids) - req.num_grammar_advanced
                assert 0 <= lag <= engine.drafter.num_nodes
        for req in sched.waiting:
            if req.preempted:
                preempted.add(req.request_id)
                if req.matcher is not None:
                    assert req.matcher.num_accepted == req.num_grammar_advanced \
                        == len(req.output_ids)
    got = [done[r] for r in rids]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.text, o.finish_reason, o.stop_reason) for o in got] == \
        [(o.text, o.finish_reason, o.stop_reason) for o in want]
    assert any(o.stop_reason in stops for o in got), "a stop string should cut an output"
    assert preempted & set(rids[:3]) and preempted & set(rids[3:])
    for rid, out in zip(rids[3:], got[3:], strict=True):
        assert matchers[rid].num_accepted == len(out.token_ids)
    assert_no_leak(small)


def test_priority_orders_admission_and_preemption(make_llm, tiny_model_dir: str) -> None:
    """Waiting requests are admitted by priority (lower first), FCFS among equals, and the
    oversubscribed run preempts only the low-priority requests."""
    small = make_llm(model=tiny_model_dir, kv_capacity_tokens=SMALL_KV_TOKENS)
    engine, sched = small.engine, small.engine.scheduler
    long = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, long, raw_prompt=True, priority=prio)
            for p, prio in zip(PROMPTS[:5], [2, 0, -1, 0, 2], strict=True)]
    assert [r.request_id for r in sched.waiting] == [rids[i] for i in (2, 1, 3, 0, 4)]
    victims: list[int] = []
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        victims += [r.priority for r in sched.waiting if r.preempted]
    assert victims and min(victims) > -1  # the priority -1 request was never preempted
    assert all(done[r].error is None and len(done[r].token_ids) == 32 for r in rids)
    assert_no_leak(small)


def test_high_priority_request_runs_at_once_behind_a_full_batch(make_llm,
                                                                tiny_model_dir: str) -> None:
    """Long requests fill every batch slot (more wait); a short request of a higher priority
    preempts one and runs at once, though its prefill is smaller than min_prefill_batch;
    the preempted request resumes and completes."""
    llm = make_llm(model=tiny_model_dir, kv_capacity_tokens=512, max_batch_size=6,
                   min_prefill_batch=4)
    engine, sched = llm.engine, llm.engine.scheduler
    long = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, long, raw_prompt=True) for p in PROMPTS[:8]]
    done: dict[str, Any] = {}
    while len(sched.running) < 6:
        engine.step()
    short_id = engine.add_request(PROMPTS[9], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True), raw_prompt=True, priority=-1)
    # its prefill (with the running requests' verify forward in the same step, chunked
    # prefill), three verify steps, the step reporting it
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert len(done[short_id].token_ids) == 4
    assert not any(r in done for r in rids)
    assert engine.stats()["num_preemptions"] >= 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert all(done[r].error is None and len(done[r].token_ids) == 32 for r in rids)
    assert_no_leak(llm)


def test_bad_priority_is_a_clear_error(make_llm, tiny_model_dir: str) -> None:
    llm = make_llm(model=tiny_model_dir, kv_capacity_tokens=SMALL_KV_TOKENS)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(TypeError, match="priority must be an int"):
        llm.generate("hi", sp, priority="high")
    with pytest.raises(TypeError, match=r"priority\[1\] must be an int"):
        llm.generate(["a", "b"], sp, priority=[0, 1.5])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], sp, priority=[0])
    with pytest.raises(RequestError, match="priority must be an integer") as e:
        llm.engine.add_request("hi", sp, priority=True)
    assert e.value.param == "priority"
    assert [o.error for o in llm.generate(["a", "b"], sp, priority=[3, -2])] == [None, None]


def test_a_request_that_can_never_fit_is_refused(make_llm, tiny_model_dir: str) -> None:
    """A request that could not run alone in the pool is refused at once, naming its field:
    preempting the others would not make it fit. The engine's context length is lowered to
    what the pool holds with one tree, so that is a prompt too long for the context."""
    llm = make_llm(model=tiny_model_dir, kv_capacity_tokens=SMALL_KV_TOKENS)
    with pytest.raises(RequestError, match="the context holds") as e:
        llm.engine.add_request("word " * SMALL_KV_TOKENS, SamplingParams(max_tokens=2),
                               raw_prompt=True)
    assert e.value.param == "prompt"
    assert llm.engine.max_model_len + llm.engine.scheduler.num_nodes <= SMALL_KV_TOKENS


def test_waiting_queue_order() -> None:
    from structspec.scheduler.request import Req
    from structspec.scheduler.waiting_queue import WaitingQueue, victim_key

    def req(i: int, prio: int, preempted: bool = False) -> Req:
        r = Req(request_id=str(i), prompt_ids=[1], params=SamplingParams(), arrival_time=0.0,
                max_new_tokens=1, eos_token_ids=frozenset(), priority=prio, arrival_seq=i)
        r.preempted = preempted
        return r

    q = WaitingQueue()
    for r in [req(0, 0), req(1, 1), req(2, 0), req(3, -1), req(4, 0, preempted=True),
              req(5, 1, preempted=True)]:
        q.push(r)
    assert [r.request_id for r in q] == ["3", "4", "0", "2", "5", "1"]
    running = [req(0, 0), req(1, 1), req(2, 1), req(3, -4)]
    assert max(running, key=victim_key).request_id == "2"  # lowest priority, newest
