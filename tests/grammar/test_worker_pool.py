"""The mask worker pool: tree bitmasks built in worker processes equal the in-process build,
step after step, as requests advance, finish, time out and new ones arrive."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint, RegexConstraint, StructuralTagConstraint
from structspec.draft_tree.layout import VerifyTree
from structspec.grammar import GrammarBackend, GrammarTree, Matcher, build_grammar_vocab_mask
from structspec.grammar.grammar_shipping import wire_form
from structspec.grammar.grammar_source import XgrSource
from structspec.grammar.tree_mask import build_grammar_vocab_mask_pooled
from structspec.grammar.worker_pool import (
    MASK_WORKER_SPIN_MS,
    MAX_SPIN_MS,
    SPIN_ENV,
    WORKER_EXIT_S,
    MaskWorkerPool,
    PoolBuildResult,
    PoolRequest,
    default_spin_ms,
    usable_cpus,
)

from .conftest import STOP_ID
from .test_tree_mask import PREFIX as TM_PREFIX
from .test_tree_mask import SCHEMA as TM_SCHEMA
from .test_tree_mask import _tree as tm_tree

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "city": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}
TEXTS = ['{"name": "Ada Lovelace", "city": "London", "age": 36}',
         '{"name": "Bo", "city": "Oslo and more words here", "age": 41}']
N = 6


@pytest.fixture(scope="module")
def pool(backend: GrammarBackend, llg_backend: Any) -> Iterator[MaskWorkerPool]:
    """Two workers that load the grammars of both backends (each builds llguidance's
    tokenizer once, from the backend's ``LlgTokenizerSource``, off its step loop). They poll
    for their next message for 2 ms before sleeping, so the tests below go through both
    ways of waiting (a message inside the window, and one after the worker slept)."""
    p = MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                       max_rows=16 * N, stop_token_ids=[STOP_ID],
                       llguidance_tokenizer=llg_backend.tokenizer_source, spin_ms=2.0)
    yield p
    p.close()


class _Req:
    """One simulated request: its text, committed ids and host matcher."""

    def __init__(self, key: str, backend: GrammarBackend, compiled: Any, ids: list[int]) -> None:
        self.key, self.ids, self.pos = key, ids, 1
        self.matcher: Matcher | None = backend.create_matcher(compiled) if compiled else None
        self.compiled = compiled
        self.output_ids: list[int] = []
        self.pending: list[int] = []
        self.reaches_stop = False

    def commit(self, k: int) -> None:
        run = self.ids[self.pos : self.pos + k]
        self.pos += len(run)
        self.output_ids += run
        self.pending += run

    def tree(self, rng: random.Random, pool_ids: list[int],
             chain_p: float = 0.6) -> VerifyTree:
        """A chain of the true next tokens with random wrong branches (one-row tree);
        ``reaches_stop``: the tree's unbroken true chain from the root holds the true stop
        token (a node the grammar allows and whose row is reset)."""
        last = self.output_ids[-1] if self.output_ids else self.ids[0]
        toks, parents = [last], [-1]
        self.reaches_stop = False
        unbroken = True
        for i in range(1, N):
            if rng.random() < chain_p and self.pos + i - 1 < len(self.ids):
                toks.append(self.ids[self.pos + i - 1])
                parents.append(i - 1)
                self.reaches_stop |= unbroken and self.pos + i - 1 == len(self.ids) - 1
            else:
                unbroken = False
                toks.append(rng.choice(pool_ids))
                parents.append(rng.randrange(i))
        return VerifyTree.from_parents(torch.tensor([toks]), torch.tensor([parents]))


def _barrier(reqs: list[_Req]) -> None:
    for r in reqs:
        if r.matcher is not None and r.pending:
            r.matcher.accept_run(r.pending)
        r.pending = []


def test_backend_grammars_ship_as_their_source(backend: GrammarBackend) -> None:
    """A grammar the backend compiled travels as its source (the worker compiles it); one
    compiled elsewhere as xgrammar's serialization."""
    spec = JsonSchemaConstraint({**SCHEMA, "title": "ship-as-source"})
    form = wire_form(backend.compile(spec))
    assert form[0] == "xgrammar" and isinstance(form[1], XgrSource)
    assert form[1].spec == spec and form[1].any_whitespace == backend.config.any_whitespace
    direct = xgr.GrammarCompiler(backend.tokenizer_info).compile_regex("[a-z]+")
    assert isinstance(wire_form(direct), str)


# "serialized" (a grammar compiled outside the backend) runs under -m slow: the suite's budget.
# "wide": 12 requests (the in-process reference settles with its numpy passes, above
# SETTLE_LIST_MAX_REQUESTS; the workers settle request by request) and mostly true chains, so
# trees reach the true stop token (a stop node's row is reset too).
@pytest.mark.parametrize(("shipped", "width", "chain_p"), [
    ("source", 7, 0.6), ("source", 12, 0.9),
    pytest.param("serialized", 7, 0.6, marks=pytest.mark.slow)])
def test_pooled_build_equals_in_process(pool: MaskWorkerPool, backend: GrammarBackend,
                                        hf_tokenizer: Any, shipped: str, width: int,
                                        chain_p: float) -> None:
    regex = r"[A-Z][a-z]+( [a-z]+){2,8}\."
    if shipped == "source":  # the engine's path: the worker compiles the source
        json_g = backend.compile(JsonSchemaConstraint(SCHEMA))
        regex_g = backend.compile(RegexConstraint(regex))
    else:  # compiled outside the backend: the worker parses xgrammar's serialization
        compiler = xgr.GrammarCompiler(backend.tokenizer_info, cache_enabled=False)
        json_g = compiler.compile_json_schema(json.dumps(SCHEMA))
        regex_g = compiler.compile_regex(regex)
    pool_ids = hf_tokenizer.encode('"name": "x", 12} abc ,.', add_special_tokens=False)
    texts = TEXTS + ["Hello big bright world today."]
    rng = random.Random(0)
    live: list[_Req] = []
    serial = 0
    builds = 0
    stops_reached = 0
    for step in range(14):
        # arrivals: constrained (JSON / regex) and unconstrained requests
        while len(live) < width:
            kind = serial % 4
            text = texts[2] if kind == 2 else texts[serial % 2]
            compiled = None if kind == 3 else (regex_g if kind == 2 else json_g)
            ids = hf_tokenizer.encode(text, add_special_tokens=False) + [STOP_ID]
            live.append(_Req(f"r{serial}", backend, compiled, ids))
            serial += 1
        trees = [r.tree(rng, pool_ids, chain_p) for r in live]
        stops_reached += sum(r.reaches_stop for r in live if r.matcher is not None)
        gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                     ("next_token", "next_sibling", "draft_tokens")))
        limit = 10.0
        pooled = build_grammar_vocab_mask_pooled(
            pool, [PoolRequest(r.key, r.compiled, list(r.output_ids)) if r.matcher else None
                   for r in live],
            [r.matcher for r in live], gt, device="cpu",
            barrier=lambda batch=live: _barrier(batch),
            time_limit_s=limit)
        ref = build_grammar_vocab_mask([r.matcher for r in live], gt,
                                       vocab_size=backend.vocab_size, device="cpu",
                                       time_limit_s=limit)
        assert pooled is not None and ref is not None
        builds += 1
        assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu), f"step {step}"
        assert pooled.truncated_requests == ref.truncated_requests
        assert pooled.rejected_by_grammar == ref.rejected_by_grammar
        # every row a worker walked to the end was settled there, with its count
        mirror = pooled.mirror
        assert mirror is not None
        assert set(mirror.settled) == set(mirror.walked) - set(mirror.timed_out)
        assert all(pooled.rejected_by_grammar[b] == c for b, c in mirror.settled.items())
        assert torch.equal(pooled.max_accept_cpu, ref.max_accept_cpu)
        # commit 1-4 tokens each; requests whose text is used up finish and are released
        for r in live:
            r.commit(rng.randint(1, 4))
        done = [r for r in live if r.pos >= len(r.ids) or
                (r.matcher is not None and r.matcher.is_terminated())]
        for r in done:
            pool.release(r.key)
        live = [r for r in live if r not in done]
    assert builds == 14 and serial > 10  # requests came and went
    if chain_p > 0.8:
        assert stops_reached > 0  # stop nodes were reached (and their rows reset)


def test_pooled_timeout_falls_back_like_in_process(pool: MaskWorkerPool,
                                                   backend: GrammarBackend,
                                                   hf_tokenizer: Any) -> None:
    """A walk over its time limit: rows reset, row 0 exact, no drafts accepted (both paths)."""
    compiled = backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    host = backend.create_matcher(compiled)
    nt, ns, dt = tm_tree(ids[-1])
    tree = GrammarTree.from_host(nt[None], ns[None], dt[None])
    pooled = build_grammar_vocab_mask_pooled(
        pool, [PoolRequest("timeout", compiled, ids)], [host], tree, device="cpu",
        barrier=lambda: host.accept_run(ids), time_limit_s=1e-9)
    ref = build_grammar_vocab_mask([host], tree, vocab_size=backend.vocab_size, device="cpu",
                                   time_limit_s=1e-9)
    pool.release("timeout")
    assert pooled is not None and ref is not None
    assert ref.truncated_requests == pooled.truncated_requests == [0]
    assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu)
    assert pooled.max_accept_cpu.tolist() == [0]


def test_pool_rejects_oversized_batch_and_bad_args(pool: MaskWorkerPool,
                                                   backend: GrammarBackend) -> None:
    big = torch.zeros((17, N), dtype=torch.int64)
    with pytest.raises(ValueError, match="exceeds"):
        pool.build([None] * 17, big, big, big, time_limit_s=1.0)
    for bad in (0, 2.5, "2"):
        with pytest.raises(ValueError, match="num_workers"):
            MaskWorkerPool(backend.tokenizer_info, num_workers=bad,  # type: ignore[arg-type]
                           vocab_size=backend.vocab_size, max_rows=8, stop_token_ids=[STOP_ID])
    for spin in (-1.0, float("nan"), float("inf"), MAX_SPIN_MS + 1, True, "5"):
        with pytest.raises(ValueError, match="spin_ms"):
            MaskWorkerPool(backend.tokenizer_info, num_workers=1, vocab_size=backend.vocab_size,
                           max_rows=8, stop_token_ids=[STOP_ID], spin_ms=spin)


def test_spin_window_follows_the_cores_and_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers spin only with a core for each of them and two to spare; the environment
    variable overrides that, and a bad value is refused naming it."""
    from structspec.grammar import worker_pool

    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.setattr(worker_pool, "usable_cpus", lambda: 16.0)
    assert default_spin_ms(8) == MASK_WORKER_SPIN_MS and default_spin_ms(14) == MASK_WORKER_SPIN_MS
    assert default_spin_ms(15) == 0.0
    monkeypatch.setattr(worker_pool, "usable_cpus", lambda: 2.0)
    assert default_spin_ms(1) == 0.0 and default_spin_ms(0) == MASK_WORKER_SPIN_MS
    monkeypatch.setattr(worker_pool, "usable_cpus", lambda: 9.5)  # a quota of 9.5 CPUs
    assert default_spin_ms(8) == 0.0 and default_spin_ms(7) == MASK_WORKER_SPIN_MS
    monkeypatch.setenv(SPIN_ENV, "3.5")
    assert default_spin_ms(1) == 3.5
    monkeypatch.setenv(SPIN_ENV, "0")
    assert default_spin_ms(0) == 0.0
    monkeypatch.setenv(SPIN_ENV, " ")  # blank: unset
    assert default_spin_ms(0) == MASK_WORKER_SPIN_MS
    monkeypatch.setenv(SPIN_ENV, str(MAX_SPIN_MS))
    assert default_spin_ms(0) == MAX_SPIN_MS
    for bad in ("-1", "fast", "nan", "inf", "1e400", "1e300", "1000.5"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ValueError, match=SPIN_ENV):
            default_spin_ms(1)


def test_usable_cpus_follow_a_cgroup_quota(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's CPU quota caps the CPUs counted (its affinity set lists every host
    CPU), so its workers do not spin on cores the quota does not give them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    cpu_max = tmp_path / "cpu.max"
    for text, want in (("max 100000\n", 16.0), ("400000 100000\n", 4.0),
                       ("150000 100000\n", 1.5), ("garbage\n", 16.0)):
        cpu_max.write_text(text)
        assert usable_cpus(str(cpu_max)) == want, text
    assert usable_cpus(str(tmp_path / "missing")) == 16.0


def test_a_spinning_pool_closes_promptly(backend: GrammarBackend) -> None:
    """A worker inside its spin window still reads the stop message at once: close() does
    not wait for the window (the longest allowed, 1 s) nor kill anyone."""
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=1, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID], spin_ms=MAX_SPIN_MS)
    procs = list(pool._procs)
    compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
    assert pool.advance([PoolRequest("spin", compiled, [])]).worker_busy_ms  # now spinning
    t0 = time.perf_counter()
    pool.close()
    # a worker that sat out its window would take >= 1 s here, still inside the shutdown's
    # limit (WORKER_EXIT_S) and with exit code 0: the bound is the window's, not the limit's
    assert time.perf_counter() - t0 < 0.8 * MAX_SPIN_MS / 1e3 < WORKER_EXIT_S
    assert [p.returncode for p in procs] == [0]


def test_before_send_runs_after_the_verdicts_and_its_failure_keeps_the_mirrors(
        pool: MaskWorkerPool, backend: GrammarBackend, hf_tokenizer: Any) -> None:
    """``before_send`` (a device tree still on its way) runs after the predicted verdicts and
    before any worker has its message, and the tree it fills in is the one walked: the rows
    equal the in-process build. When it raises, the messages still go (without the tree),
    the error comes after the replies, and the mirrors stay in step: the next build equals
    the in-process one. Without ``on_verdicts`` it is refused."""
    compiled = backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    nt, ns, dt = tm_tree(ids[-1])
    n = nt.shape[0]
    hosts = [backend.create_matcher(compiled) for _ in range(2)]
    keys = ["before-send-0", "before-send-1"]
    log: list[str] = []
    # the "device tree": host buffers that before_send fills in, as the D2H copy would
    bufs = [torch.full((2, n), -7, dtype=torch.int64) for _ in range(3)]
    tree = GrammarTree.from_host(*bufs)

    def land() -> None:
        # no message has gone out yet (the pool marks the build's workers once it has sent)
        log.append("before_send" if pool._walks_pending is None else "before_send, too late")
        for buf, src in zip(bufs, (nt, ns, dt), strict=True):
            buf.copy_(src[None].expand(2, -1))

    def build(before_send: Any, committed: list[int]) -> PoolBuildResult:
        """A build over ``committed`` ids; the host matchers take them meanwhile."""
        def host_barrier() -> None:  # not run when before_send raised: caught up later
            for h in hosts:
                h.accept_run(committed[host_done[0]:])
            host_done[0] = len(committed)

        return pool.build([PoolRequest(k, compiled, committed) for k in keys], *bufs,
                          time_limit_s=10.0, on_verdicts=lambda _: log.append("verdicts"),
                          before_send=before_send, while_waiting=host_barrier)

    def reference() -> torch.Tensor:
        ref = build_grammar_vocab_mask(hosts, tree, vocab_size=backend.vocab_size,
                                       device="cpu")
        assert ref is not None
        return ref.bitmask_cpu

    host_done = [0]  # committed ids the host matchers have taken
    got = build(land, ids[:-3])
    assert log == ["verdicts", "before_send"]
    # the workers walked the tree before_send filled in (the buffers held -7s before it)
    assert got.walked == [0, 1] and torch.equal(pool.slab[: 2 * n], reference())

    def fail() -> None:
        raise RuntimeError("the copy failed")

    with pytest.raises(RuntimeError, match="the copy failed"):
        build(fail, ids[:-1])  # two more ids each reach the mirrors, no tree walked
    got = build(land, ids)
    assert not got.mismatched and got.walked == [0, 1]
    assert torch.equal(pool.slab[: 2 * n], reference())
    with pytest.raises(ValueError, match="before_send needs on_verdicts"):
        pool.build([None], bufs[0][:1], bufs[1][:1], bufs[2][:1], time_limit_s=1.0,
                   before_send=land)
    for k in keys:
        pool.release(k)


@pytest.fixture(scope="module")
def socket_pool(backend: GrammarBackend) -> Iterator[MaskWorkerPool]:
    """Two xgrammar workers that always sleep between messages (``spin_ms=0``): their jobs and
    replies go over the sockets, as a CPU engine's do (the spinning ``pool`` uses shared-memory
    mailboxes on x86-64)."""
    p = MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                       max_rows=16 * N, stop_token_ids=[STOP_ID], spin_ms=0.0)
    assert p.mailboxes is None
    yield p
    p.close()


@pytest.mark.parametrize("channel", ["mailboxes", "sockets"])
def test_walks_ready_turns_true_once_every_walk_is_in(request: pytest.FixtureRequest,
                                                      backend: GrammarBackend,
                                                      hf_tokenizer: Any, channel: str) -> None:
    """``walks_ready`` is False outside a build, and inside one becomes True (without
    blocking) once both workers have sent their walks; the build then returns the same rows
    as the in-process build. Through the mailboxes of spinning workers and the sockets of
    sleeping ones."""
    import time
    from multiprocessing.connection import wait

    from structspec.grammar.mailbox import supported

    if channel == "mailboxes" and not supported():
        pytest.skip("shared-memory mailboxes need x86-64")
    pool: MaskWorkerPool = request.getfixturevalue("pool" if channel == "mailboxes"
                                                   else "socket_pool")
    assert (pool.mailboxes is not None) == (channel == "mailboxes")
    compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
    ids = hf_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    reqs = [_Req(f"ready{i}", backend, compiled, ids + [STOP_ID]) for i in range(4)]
    trees = [r.tree(random.Random(i), ids) for i, r in enumerate(reqs)]
    gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                 ("next_token", "next_sibling", "draft_tokens")))
    assert not pool.walks_ready()
    seen: list[bool] = []

    def wait_for_walks() -> None:
        deadline = time.perf_counter() + 30
        while not pool.walks_ready():
            left = deadline - time.perf_counter()
            assert left > 0, "walk replies never arrived"
            if pool.mailboxes is None:  # block on the sockets still owing a walk reply
                wait([pool._conns[w] for w in pool._walks_pending or ()], timeout=left)
            else:  # a mailbox has nothing to block on
                time.sleep(1e-4)
        # True means the replies really are there: in both outboxes, or on both sockets
        if pool.mailboxes is None:
            assert all(pool._conns[w].poll() for w in range(pool.num_workers))
        else:
            assert all(mb.seq_out() == sent for mb, sent in
                       zip(pool.mailboxes, pool._jobs_sent, strict=True))
        seen.append(pool.walks_ready())  # stays True once seen

    pooled = build_grammar_vocab_mask_pooled(
        pool, [PoolRequest(r.key, r.compiled, []) for r in reqs], [r.matcher for r in reqs],
        gt, device="cpu", barrier=wait_for_walks, time_limit_s=10.0)
    ref = build_grammar_vocab_mask([r.matcher for r in reqs], gt,
                                   vocab_size=backend.vocab_size, device="cpu",
                                   time_limit_s=10.0)
    for r in reqs:
        pool.release(r.key)
    assert seen == [True] and not pool.walks_ready()
    assert pooled is not None and ref is not None
    assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu)


def test_new_requests_go_to_the_least_loaded_worker(backend: GrammarBackend) -> None:
    """Placement keeps the shares even as requests come and go: after worker 0's requests
    finish, the next new request goes to worker 0 (round-robin would put it next to worker
    1's). Counted by the workers each round trip messages."""
    compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID])
    try:
        a, b, c, d = (PoolRequest(f"place{i}", compiled, []) for i in range(4))
        assert len(pool.advance([a, b, c]).worker_busy_ms) == 2  # a, c: worker 0; b: 1
        pool.release(a.key)
        pool.release(c.key)
        assert len(pool.advance([]).worker_busy_ms) == 1  # worker 0 drops its mirrors
        assert len(pool.advance([b, d]).worker_busy_ms) == 2  # d: worker 0 (0 live vs 1)
    finally:
        pool.close()


def _wait_shipped(pool: MaskWorkerPool, key: str, compiled: Any) -> None:
    """Collect acknowledgements until ``key``'s grammar is on its worker (the scheduler polls
    once per step instead)."""
    import time

    deadline = time.perf_counter() + 60
    while not pool.ready(key, compiled):
        assert time.perf_counter() < deadline, "the grammar never reached its worker"
        pool.collect_shipped()
        time.sleep(0.005)


def test_grammars_ship_off_the_caller_and_local_rows_match(pool: MaskWorkerPool,
                                                            backend: GrammarBackend,
                                                            hf_tokenizer: Any) -> None:
    """A request's first sight places it and queues its grammar without waiting: ``ready``
    stays False until an acknowledgement is collected. Meanwhile its rows are walked in this
    process (``local``) in the same build as the rows on the workers, and the bitmask equals
    the all-in-process build; once shipped, the request moves to its worker (a mirror that
    catches up on every output id) with the same rows."""
    json_g = backend.compile(JsonSchemaConstraint(SCHEMA))
    # grammars no earlier test shipped (their requests may still hold the others)
    regex_g = backend.compile(RegexConstraint(r"[A-Z][a-z]+( [a-z]+){2,9}\."))
    open_g = backend.compile(JsonSchemaConstraint({**SCHEMA, "additionalProperties": True}))
    pool_ids = hf_tokenizer.encode('"name": "x", 12} abc ,.', add_special_tokens=False)
    texts = [TEXTS[0], "Hello big bright world today.", TEXTS[1]]
    grammars = [json_g, regex_g, open_g]
    reqs = [_Req(f"ship{i}", backend, g, hf_tokenizer.encode(t, add_special_tokens=False)
                 + [STOP_ID]) for i, (g, t) in enumerate(zip(grammars, texts, strict=True))]
    _wait_shipped(pool, reqs[0].key, json_g)  # row 0 on a worker; rows 1, 2 arrive later
    before = pool.ship_ms
    assert not pool.ready(reqs[1].key, regex_g)  # placed now, its grammar queued
    assert not pool.ready(reqs[2].key, open_g)
    assert pool.ship_ms - before < 50  # queueing only: no serialization on this thread
    rng = random.Random(3)
    for step in range(4):
        on_worker = [pool.ready(r.key, r.compiled) for r in reqs]
        trees = [r.tree(rng, pool_ids) for r in reqs]
        gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                     ("next_token", "next_sibling", "draft_tokens")))
        pooled = build_grammar_vocab_mask_pooled(
            pool, [PoolRequest(r.key, r.compiled, list(r.output_ids)) if ok else None
                   for r, ok in zip(reqs, on_worker, strict=True)],
            [r.matcher for r in reqs], gt, device="cpu",
            barrier=lambda: _barrier(reqs), time_limit_s=10.0,
            local=[b for b, ok in enumerate(on_worker) if not ok])
        ref = build_grammar_vocab_mask([r.matcher for r in reqs], gt,
                                       vocab_size=backend.vocab_size, device="cpu",
                                       time_limit_s=10.0)
        assert pooled is not None and ref is not None
        assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu), (step, on_worker)
        assert pooled.rejected_by_grammar == ref.rejected_by_grammar
        if step == 1:
            assert not all(on_worker)  # some steps really mixed local and worker rows
            for r in reqs:
                _wait_shipped(pool, r.key, r.compiled)
        for r in reqs:
            r.commit(rng.randint(1, 3))
    for r in reqs:
        pool.release(r.key)


def test_grammar_released_in_flight_is_forgotten_on_arrival(backend: GrammarBackend) -> None:
    """A request that finishes while its grammar is on its way: the acknowledgement still
    arrives, and the worker's copy is dropped with its next message (nothing left known)."""
    compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=1, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID])
    try:
        assert not pool.ready("gone", compiled)
        pool.release("gone")
        import time

        deadline = time.perf_counter() + 60
        while pool.shipping.in_flight[0]:  # the test watches the shipment end
            assert time.perf_counter() < deadline
            pool.collect_shipped()
            time.sleep(0.005)
        assert pool.shipping.known == [{}] and pool.shipping.dropped == [[0]]
        assert len(pool.advance([]).worker_busy_ms) == 1  # the drop goes out
        assert pool.shipping.dropped == [[]]
        # the same grammar again: a new shipment under a new wire id
        assert not pool.ready("again", compiled)
        assert pool.num_shipped == 2
    finally:
        pool.close()


@pytest.mark.parametrize("llg_local", [False, True], ids=["all-on-workers", "llg-local"])
def test_mixed_backends_pooled_equals_in_process(pool: MaskWorkerPool,
                                                 backend: GrammarBackend, llg_backend: Any,
                                                 hf_tokenizer: Any, llg_local: bool) -> None:
    """A batch of half xgrammar and half llguidance requests (JSON and regex): the workers'
    bitmask (llguidance mirrors compiled in the workers from the shipped grammar text), or
    with the llguidance rows walked here (``llg_local``), equals the all-in-process build,
    step after step, and the mirrors' verdicts match the host matchers'."""
    regex = RegexConstraint(r"[A-Z][a-z]+( [a-z]+){2,8}\.")
    grammars = [(backend, backend.compile(JsonSchemaConstraint(SCHEMA))),
                (llg_backend, llg_backend.compile(JsonSchemaConstraint(SCHEMA))),
                (backend, backend.compile(regex)), (llg_backend, llg_backend.compile(regex))]
    texts = [TEXTS[0], TEXTS[1], "Hello big bright world today.", "Hello big bright world."]
    pool_ids = hf_tokenizer.encode('"name": "x", 12} abc ,.', add_special_tokens=False)
    reqs = [_Req(f"mix{llg_local}{i}", be, g,
                 hf_tokenizer.encode(texts[i], add_special_tokens=False) + [STOP_ID])
            for i, (be, g) in enumerate(grammars)]
    on_worker = [not (llg_local and r.matcher is not None and r.matcher.backend == "llguidance")
                 for r in reqs]
    for r, ok in zip(reqs, on_worker, strict=True):
        assert pool.serves(r.compiled)
        if ok:
            _wait_shipped(pool, r.key, r.compiled)
    rng = random.Random(7)
    for step in range(5):
        trees = [r.tree(rng, pool_ids) for r in reqs]
        gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                     ("next_token", "next_sibling", "draft_tokens")))
        pooled = build_grammar_vocab_mask_pooled(
            pool, [PoolRequest(r.key, r.compiled, list(r.output_ids)) if ok else None
                        for r, ok in zip(reqs, on_worker, strict=True)],
            [r.matcher for r in reqs], gt, device="cpu",
            barrier=lambda: _barrier(reqs), time_limit_s=10.0,
            local=[b for b, ok in enumerate(on_worker) if not ok])
        ref = build_grammar_vocab_mask([r.matcher for r in reqs], gt,
                                       vocab_size=backend.vocab_size, device="cpu",
                                       time_limit_s=10.0)
        assert pooled is not None and ref is not None
        assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu), step
        assert pooled.rejected_by_grammar == ref.rejected_by_grammar
        assert pooled.mirror is not None and not pooled.mirror.mismatched
        for r in reqs:
            r.commit(rng.randint(1, 3))
    for r in reqs:
        pool.release(r.key)


def test_llguidance_timeout_on_worker_falls_back_like_in_process(
        pool: MaskWorkerPool, llg_backend: Any, hf_tokenizer: Any) -> None:
    """An llguidance walk over its time limit in a worker: rows reset, row 0 exact, no
    drafts accepted, as in process."""
    compiled = llg_backend.compile(JsonSchemaConstraint(TM_SCHEMA))
    ids = hf_tokenizer.encode(TM_PREFIX, add_special_tokens=False)
    host = llg_backend.create_matcher(compiled)
    _wait_shipped(pool, "llg-timeout", compiled)
    nt, ns, dt = tm_tree(ids[-1])
    tree = GrammarTree.from_host(nt[None], ns[None], dt[None])
    pooled = build_grammar_vocab_mask_pooled(
        pool, [PoolRequest("llg-timeout", compiled, ids)], [host], tree, device="cpu",
        barrier=lambda: host.accept_run(ids), time_limit_s=1e-9)
    ref = build_grammar_vocab_mask([host], tree, vocab_size=llg_backend.vocab_size,
                                   device="cpu", time_limit_s=1e-9)
    pool.release("llg-timeout")
    assert pooled is not None and ref is not None
    assert ref.truncated_requests == pooled.truncated_requests == [0]
    assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu)
    assert pooled.max_accept_cpu.tolist() == [0]


def test_pool_serves_the_backends_it_was_given(pool: MaskWorkerPool, llg_backend: Any,
                                               backend: GrammarBackend) -> None:
    assert pool.backends == {"xgrammar", "llguidance"}
    assert pool.serves(backend.compile(RegexConstraint("[a-z]+")))
    assert pool.serves(llg_backend.compile(RegexConstraint("[a-z]+")))
    with pytest.raises(ValueError, match="tokenizer_info"):  # before any process starts
        MaskWorkerPool(None, num_workers=1, vocab_size=backend.vocab_size, max_rows=8,
                       stop_token_ids=[STOP_ID])


STRUCTURAL_TAG = {"structures": [{"begin": "<function=get_weather>",
                                  "schema": {"type": "object",
                                             "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}},
                                             "required": ["city", "days"]},
                                  "end": "</function>"}],
                  "triggers": ["<function="]}


def test_structural_tag_ships_as_its_source_and_masks_match(pool: MaskWorkerPool,
                                                            backend: GrammarBackend,
                                                            hf_tokenizer: Any) -> None:
    """A structural tag's grammar travels as its source, as the other kinds' do (the worker
    compiles the tag itself), and its tree bitmasks equal the in-process build step after
    step, through free text, the trigger, the begin string, the JSON body and the end."""
    spec = StructuralTagConstraint(STRUCTURAL_TAG)
    compiled = backend.compile(spec)
    form = wire_form(compiled)
    assert form[0] == "xgrammar" and isinstance(form[1], XgrSource) and form[1].spec == spec
    texts = ['Checking. <function=get_weather>{"city": "Paris", "days": 3}</function> Done.',
             'Sure <function=get_weather>{"city": "Oslo", "days": 12}</function>',
             "No call needed here, just words."]
    reqs = [_Req(f"stag{i}", backend, compiled,
                 hf_tokenizer.encode(t, add_special_tokens=False) + [STOP_ID])
            for i, t in enumerate(texts)]
    for r in reqs:
        _wait_shipped(pool, r.key, compiled)
    pool_ids = hf_tokenizer.encode('<function=get_weather>{"city": "x", 1} abc </function>',
                                   add_special_tokens=False)
    rng = random.Random(5)
    steps = 0
    while reqs and steps < 40:
        trees = [r.tree(rng, pool_ids, chain_p=0.8) for r in reqs]
        gt = GrammarTree.from_host(*(torch.cat([getattr(t, f) for t in trees]) for f in
                                     ("next_token", "next_sibling", "draft_tokens")))
        pooled = build_grammar_vocab_mask_pooled(
            pool, [PoolRequest(r.key, r.compiled, list(r.output_ids)) for r in reqs],
            [r.matcher for r in reqs], gt, device="cpu", barrier=lambda b=reqs: _barrier(b),
            time_limit_s=10.0)
        ref = build_grammar_vocab_mask([r.matcher for r in reqs], gt,
                                       vocab_size=backend.vocab_size, device="cpu",
                                       time_limit_s=10.0)
        assert pooled is not None and ref is not None
        assert torch.equal(pooled.bitmask_cpu, ref.bitmask_cpu), steps
        assert pooled.rejected_by_grammar == ref.rejected_by_grammar
        assert torch.equal(pooled.max_accept_cpu, ref.max_accept_cpu)
        for r in reqs:
            r.commit(rng.randint(1, 4))
        done = [r for r in reqs if r.pos >= len(r.ids)]
        for r in done:
            pool.release(r.key)
            _barrier([r])
            assert r.matcher is not None and r.matcher.is_terminated()  # all in the language
        reqs = [r for r in reqs if r not in done]
        steps += 1
    assert not reqs, "the texts were not used up"
