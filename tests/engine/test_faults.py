"""Faults stay local (docs/architecture.md, invariant 5): a drafter that raises and a request
whose logits turn NaN. The other requests finish with exactly the output they have without
the fault. (A mask worker killed mid-run: tests/engine/test_spec.py,
``test_dead_mask_worker_falls_back_in_process``.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from structspec import FinishReason, JsonSchemaConstraint, SamplingParams
from structspec.draft_tree.layout import VerifyTree
from structspec.scheduler.commit import NON_FINITE_LOGITS_ERROR
from structspec.scheduler.draft_guard import MAX_DRAFTER_FAILURES
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.registry import registered_drafter
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS

PARAMS = [SamplingParams(max_tokens=24, grammar=JsonSchemaConstraint(PERSON_SCHEMA) if i % 2
                         else None) for i in range(5)]


class FaultyDrafter(Drafter):
    """Proposes chains repeating the last committed token (host trees), and raises where the
    test says: ``fails(where, reqs)`` is asked before each call."""

    name = "faulty"
    tree_on_host = True
    supports_grammar_overlap = True

    def __init__(self, num_nodes: int) -> None:
        super().__init__(num_nodes)
        self.fails: Callable[[str, Sequence[DraftRequest]], bool] = lambda where, reqs: False
        self.calls = 0

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        self.calls += 1
        if self.fails("propose", reqs):
            raise RuntimeError("drafter fault injected by the test")
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.int64)
        tokens = last.unsqueeze(1).expand(len(reqs), self.num_nodes).contiguous()
        parents = torch.arange(-1, self.num_nodes - 1, dtype=torch.int64).expand(
            len(reqs), self.num_nodes).contiguous()
        return VerifyTree.from_parents(tokens, parents)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        if self.fails("on_verified", reqs):
            raise RuntimeError("drafter hook fault injected by the test")


@pytest.fixture(scope="module")
def reference(make_llm: Callable[..., Any]) -> list[Any]:
    """The outputs without speculation and without faults (greedy, fp32)."""
    return make_llm().generate(PROMPTS[:5], PARAMS)


@pytest.fixture
def faulty_llm(make_llm: Callable[..., Any]) -> Iterator[Any]:
    """The cached engine with the registered faulty drafter, its guard reset after the test."""
    with registered_drafter("faulty", lambda spec, **_: FaultyDrafter(spec.num_draft_tokens)):
        llm = make_llm(speculative_algorithm="faulty", num_draft_tokens=4)
    guard = llm.engine.scheduler.draft
    try:
        yield llm
    finally:
        llm.engine.drafter.fails = lambda where, reqs: False
        guard.stopped.clear()
        guard.num_failures = 0
        guard.disabled = False


def _same_as(reference: list[Any], got: list[Any]) -> None:
    for a, b in zip(reference, got, strict=True):
        assert b.error is None, b.error
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason


# on_verified under -m slow: the same containment path as propose (the suite's time budget)
@pytest.mark.parametrize("where", ["propose", pytest.param("on_verified", marks=pytest.mark.slow)])
def test_drafter_failing_for_one_request_costs_no_request(
        faulty_llm: Any, reference: list[Any], where: str) -> None:
    """The drafter raises whenever request 2 is in its call. ``propose``: the batched call
    fails, the retries one request at a time find request 2, which stops speculating (and is
    released from the drafter) while the others speculate on. ``on_verified`` (a hook, not
    retried): every request of that call stops speculating. Either way no request fails and
    every output equals the run without speculation."""
    drafter = faulty_llm.engine.drafter
    guard = faulty_llm.engine.scheduler.draft
    failed: list[int] = []

    def fails(at: str, reqs: Sequence[DraftRequest]) -> bool:
        hit = at == where and any(r.request_id.endswith("-2") for r in reqs)
        if hit:
            failed.append(len(reqs))
        return hit

    drafter.fails = fails
    got = faulty_llm.generate(PROMPTS[:5], PARAMS)
    _same_as(reference, got)
    assert guard.num_failures == 1 and not guard.disabled
    if where == "propose":
        # the batch (how many were admitted with it depends on when their grammars
        # compiled), then request 2 alone
        assert len(failed) == 2 and failed[0] > 1 and failed[1] == 1, failed
        # the others kept getting drafts; request 2 never had one verified
        assert all(o.spec.draft_tokens_proposed > 0 for i, o in enumerate(got) if i != 2)
        assert got[2].spec.draft_tokens_proposed == 0
    else:
        assert len(failed) == 1, failed  # one hook call, not retried
    assert not guard.stopped  # released with the requests


def test_drafter_failing_always_turns_speculation_off(faulty_llm: Any,
                                                      reference: list[Any]) -> None:
    """A drafter that raises on every call: the first step finds every request failing (they
    decode without speculation, outputs unchanged); after MAX_DRAFTER_FAILURES such steps the
    engine stops calling it at all."""
    drafter = faulty_llm.engine.drafter
    guard = faulty_llm.engine.scheduler.draft
    sizes: list[int] = []  # the batch size of each propose call, in order

    def fails(where: str, reqs: Sequence[DraftRequest]) -> bool:
        if where == "propose":
            sizes.append(len(reqs))
        return where == "propose"

    drafter.fails = fails
    got = faulty_llm.generate(PROMPTS[:5], PARAMS)
    _same_as(reference, got)
    # Each failing step calls the batch, then each of its requests alone (a batch of one is
    # not asked again). Usually one step holds all five; the constrained requests join a
    # step later when their grammars compile late (a loaded machine), each such step counted.
    steps, i = [], 0
    while i < len(sizes):
        k = sizes[i]
        assert sizes[i + 1: i + 1 + k] == ([1] * k if k > 1 else []), sizes
        steps.append(k)
        i += 1 + (k if k > 1 else 0)
    assert sum(steps) == 5 and guard.num_failures == len(steps) < MAX_DRAFTER_FAILURES, sizes
    calls = len(sizes)
    short = SamplingParams(max_tokens=3)
    for _ in range(MAX_DRAFTER_FAILURES - len(steps)):  # one failing step per new request
        (out,) = faulty_llm.generate(PROMPTS[5], short)
        assert out.error is None and len(out.token_ids) == 3
        calls += 1
    assert guard.disabled and len(sizes) == calls
    (out,) = faulty_llm.generate(PROMPTS[5], short)
    assert out.error is None and len(sizes) == calls  # not called any more


def _poison(runner: Any, method: str, monkeypatch: pytest.MonkeyPatch,
            victim: Callable[..., int | None]) -> list[int]:
    """Wrap ``runner.<method>`` (``verify`` or ``prefill``): after the forward, fill the
    logits of the batch row ``victim(*args)`` (None: leave them) with NaN. Returns the rows
    hit."""
    forward = getattr(runner, method)
    hit: list[int] = []

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        b = victim(*args)
        if b is not None:
            bsz = len(args[1])  # seq_lens (verify) / pages (prefill): one per request
            out.logits.view(bsz, -1, out.logits.shape[-1])[b] = float("nan")
            hit.append(b)
        return out

    monkeypatch.setattr(runner, method, poisoned)
    return hit


# greedy under -m slow: the sampled run goes through the same NaN check plus the sampler
@pytest.mark.parametrize("sampling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_nan_logits_end_only_their_request(make_llm: Callable[..., Any], reference: list[Any],
                                           sampling: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN logits in one request's rows of a decode forward (a model fault): that request
    ends with an error and keeps what it had committed; the others, greedy or sampled with
    seeds, finish exactly as without the fault (sampling would otherwise fail the batch)."""
    llm = make_llm()
    params = PARAMS
    if sampling:
        params = [SamplingParams(max_tokens=16, grammar=p.grammar, temperature=0.8, seed=i)
                  for i, p in enumerate(PARAMS)]
        reference = llm.generate(PROMPTS[:5], params)
    sched = llm.engine.scheduler
    steps = [0]

    def victim(*_: Any) -> int | None:
        steps[0] += 1
        if steps[0] != 3:
            return None
        batch = [r for r in sched.running if not r.finished]  # the verify step's order
        return next(i for i, r in enumerate(batch) if r.request_id.endswith("-1"))

    hit = _poison(llm.engine.runner, "verify", monkeypatch, victim)
    got = llm.generate(PROMPTS[:5], params)
    assert len(hit) == 1
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        if i == 1:
            assert b.finish_reason is FinishReason.ABORT and b.error == NON_FINITE_LOGITS_ERROR
            assert 0 < len(b.token_ids) < len(a.token_ids)
            assert a.token_ids[: len(b.token_ids)] == b.token_ids
        else:
            assert b.error is None and b.token_ids == a.token_ids, i
            assert b.finish_reason == a.finish_reason


def test_nan_logits_in_prefill_end_only_their_request(make_llm: Callable[..., Any],
                                                      reference: list[Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN logits in one prompt's prefill rows: that request ends with an error and no token;
    the others run on unchanged."""
    llm = make_llm()
    target = llm.engine.tokenize_prompt(PROMPTS[3])

    def victim(prompts: list[list[int]], *_: Any) -> int | None:
        # requests are admitted as their grammars compile: find request 3 by its prompt
        return next((i for i, p in enumerate(prompts) if list(p) == target), None)

    _poison(llm.engine.runner, "prefill", monkeypatch, victim)
    got = llm.generate(PROMPTS[:5], PARAMS)
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        if i == 3:
            assert b.finish_reason is FinishReason.ABORT and b.error == NON_FINITE_LOGITS_ERROR
            assert b.token_ids == []
        else:
            assert b.error is None and b.token_ids == a.token_ids, i
