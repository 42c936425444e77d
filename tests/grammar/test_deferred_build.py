"""Deferred mask builds (structspec/grammar/deferred_build.py): each worker stores its flag
only after its rows and caps, so what a device waiting on the flags would read equals the
in-process build; timed-out walks cap at 0; a dead worker never stores its flag, and the
failure path writes the rows and releases the flags before the segment is freed.

On the CPU nothing waits on the device: the tests read the segment the moment the flags
hold the build's number, as the device's copy would."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend, GrammarTree, build_grammar_vocab_mask
from structspec.grammar.tree_mask import build_grammar_vocab_mask_pooled
from structspec.grammar.worker_pool import MaskPoolError, MaskWorkerPool, PoolRequest

from .conftest import STOP_ID
from .test_tree_mask import PREFIX as TM_PREFIX
from .test_tree_mask import SCHEMA as TM_SCHEMA
from .test_tree_mask import _tree as tm_tree
from .test_worker_pool import SCHEMA, TEXTS, N, _barrier, _Req

FLAG_WAIT_S = 10.0


def _pool(backend: GrammarBackend) -> MaskWorkerPool:
    return MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                          max_rows=8 * N, stop_token_ids=[STOP_ID], spin_ms=20.0)


@pytest.fixture(scope="module")
def pool(backend: GrammarBackend) -> Iterator[MaskWorkerPool]:
    """Two spinning workers, shared by the tests that leave them alive."""
    p = _pool(backend)
    yield p
    p.close()


@pytest.fixture
def doomed_pool(backend: GrammarBackend) -> Iterator[MaskWorkerPool]:
    """A pool of its own for a test that kills a worker."""
    p = _pool(backend)
    yield p
    p.close()


def _at_flags(handle: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and caps at the moment every busy worker's flag holds the build's number
    (what the device's gated copy reads)."""
    deadline = time.monotonic() + FLAG_WAIT_S
    while not handle.flags_set():
        assert time.monotonic() < deadline, "a worker never stored its flag"
    return handle.rows.clone(), handle.caps.clone()


def _tm_case(backend: GrammarBackend, hf_tokenizer: Any
             ) -> tuple[Any, list[int], tuple[torch.Tensor, ...]]:
    """test_tree_mask's schema compiled, its prefix ids, and its tree's links
    (``next_token, next_sibling, draft_tokens``, ``[N]`` each)."""
    compiled = backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    return compiled, ids, tm_tree(ids[-1])


def _placed_pair(pool: MaskWorkerPool, backend: GrammarBackend, hf_tokenizer: Any,
                 prefix: str) -> tuple[list[PoolRequest], list[torch.Tensor]]:
    """Two requests over the same tree, placed one on each worker by a first build."""
    compiled, ids, links = _tm_case(backend, hf_tokenizer)
    two = [torch.stack([t, t]) for t in links]
    reqs = [PoolRequest(f"{prefix}{i}", compiled, ids) for i in range(2)]
    pool.build(reqs, *two, time_limit_s=10.0)
    return reqs, two


def test_flags_follow_rows_and_caps_step_after_step(pool: MaskWorkerPool,
                                                    backend: GrammarBackend,
                                                    hf_tokenizer: Any) -> None:
    compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
    pool_ids = hf_tokenizer.encode('"name": "x", 12} abc ,.', add_special_tokens=False)
    rng = random.Random(1)
    live = [_Req(f"d{i}", backend, compiled if i % 3 else None,
                 hf_tokenizer.encode(TEXTS[i % 2], add_special_tokens=False) + [STOP_ID])
            for i in range(6)]
    seqs = []
    for step in range(8):
        trees = [r.tree(rng, pool_ids) for r in live]
        gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                     ("next_token", "next_sibling", "draft_tokens")))
        _barrier(live)  # the host matchers first: the reference below needs them current
        handle = pool.build_deferred(
            [PoolRequest(r.key, r.compiled, list(r.output_ids)) if r.matcher else None
             for r in live], gt.next_token_cpu, gt.next_sibling_cpu, gt.draft_tokens_cpu,
            time_limit_s=10.0, parents=gt.parents)
        with pytest.raises(MaskPoolError, match="never read"):  # one deferred build at a time
            pool.advance([None])
        rows, caps = _at_flags(handle)
        result = handle.finish()
        ref = build_grammar_vocab_mask([r.matcher for r in live], gt,
                                       vocab_size=backend.vocab_size, device="cpu",
                                       time_limit_s=10.0)
        assert ref is not None
        assert torch.equal(rows, ref.bitmask_cpu), f"step {step}"
        assert caps.tolist() == ref.max_accept_cpu.tolist() == [N - 1] * len(live)
        assert result.walked and not result.timed_out
        assert handle.finish() is result  # once
        seqs.append(handle.seq)
        for r in live:
            r.commit(rng.randint(1, 3))
    assert len(set(seqs)) == len(seqs) and 0 not in seqs
    # a plain build after deferred ones stores no flag
    before = pool.flags.copy()
    pool.advance([None])
    assert (pool.flags == before).all()


def test_a_timed_out_walk_caps_its_row_at_zero(pool: MaskWorkerPool, backend: GrammarBackend,
                                              hf_tokenizer: Any) -> None:
    compiled = backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    host = backend.create_matcher(compiled)
    host.accept_run(ids)
    nt, ns, dt = tm_tree(ids[-1])
    two = [torch.stack([t, t]) for t in (nt, ns, dt)]
    tree = GrammarTree.from_host(*two)
    handle = pool.build_deferred([PoolRequest("slow", compiled, ids), None], *two,
                                 time_limit_s=1e-9, parents=tree.parents)
    rows, caps = _at_flags(handle)
    assert handle.finish().timed_out == [0]
    assert caps.tolist() == [0, nt.shape[0] - 1]  # the unconstrained row keeps N - 1
    ref = build_grammar_vocab_mask([host, None], tree, vocab_size=backend.vocab_size,
                                   device="cpu", time_limit_s=1e-9)
    assert ref is not None and torch.equal(rows, ref.bitmask_cpu)


def test_a_dead_worker_stores_no_flag_and_close_releases_after_it_exits(
        doomed_pool: MaskWorkerPool, backend: GrammarBackend, hf_tokenizer: Any) -> None:
    pool = doomed_pool
    reqs, two = _placed_pair(pool, backend, hf_tokenizer, "k")
    victim = pool._procs[0]
    victim.kill()
    victim.wait()
    handle = pool.build_deferred(reqs, *two, time_limit_s=10.0)
    with pytest.raises(MaskPoolError, match="died|exited"):
        handle.finish()
    assert not handle.flags_set()
    seen: list[tuple[bool, bool]] = []

    def before_free() -> None:
        # every worker has exited: the rows written here are the ones the device reads
        seen.append((all(p.poll() is not None for p in pool._procs), handle.flags_set()))
        handle.rows.fill_(-1)
        handle.release()
        seen.append((True, handle.flags_set()))

    pool.close(before_free)
    assert seen == [(True, False), (True, True)]


def test_defer_without_a_device_gate_builds_as_before(pool: MaskWorkerPool,
                                                      backend: GrammarBackend,
                                                      hf_tokenizer: Any) -> None:
    compiled = backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    host = backend.create_matcher(compiled)
    nt, ns, dt = tm_tree(ids[-1])
    tree = GrammarTree.from_host(nt[None], ns[None], dt[None])
    assert not pool.device_gate  # CPU: nothing to wait on
    mask = build_grammar_vocab_mask_pooled(
        pool, [PoolRequest("plain", compiled, ids)], [host], tree, device="cpu",
        barrier=lambda: host.accept_run(ids), time_limit_s=10.0, defer=True)
    assert mask is not None and mask.pending is None and mask.caps_pinned is None
    assert mask.mirror is not None and pool.deferred is None


def test_an_unread_build_is_released_when_its_pool_closes(backend: GrammarBackend,
                                                          hf_tokenizer: Any) -> None:
    """A deferred build whose replies were never read (a step that raised): closing the pool
    stores its flags before the segment is freed; once read, it is no longer a close hook."""
    compiled, ids, links = _tm_case(backend, hf_tokenizer)
    tree = [t[None] for t in links]
    p = _pool(backend)
    try:
        read = p.build_deferred([PoolRequest("r", compiled, ids)], *tree, time_limit_s=10.0)
        read.finish()
        assert read.release not in p._before_free and p.deferred is None
        unread = p.build_deferred([PoolRequest("r", compiled, ids)], *tree,
                                  time_limit_s=10.0)
        assert p.deferred is unread and unread.release in p._before_free
    finally:
        p.close()
    assert unread._released and not read._released


def test_a_stopped_worker_fails_the_build_after_the_reply_timeout(
        doomed_pool: MaskWorkerPool, backend: GrammarBackend, hf_tokenizer: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that stops replying without dying (SIGSTOP: stuck) fails the build after
    REPLY_TIMEOUT_S instead of holding the step loop for good; the pool's close kills it."""
    import signal

    from structspec.grammar import worker_pool

    pool = doomed_pool
    reqs, two = _placed_pair(pool, backend, hf_tokenizer, "s")
    monkeypatch.setattr(worker_pool, "REPLY_TIMEOUT_S", 0.3)
    stuck = pool._procs[1]
    stuck.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(MaskPoolError, match="did not reply within"):
            pool.build(reqs, *two, time_limit_s=10.0)
        pool.close()
        assert stuck.poll() is not None  # killed and reaped, though stopped
    finally:
        if stuck.poll() is None:
            stuck.send_signal(signal.SIGCONT)
