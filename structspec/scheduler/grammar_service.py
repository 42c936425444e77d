"""The grammar side of the engine behind one API: compile, barrier, tree bitmask.

:class:`GrammarService` owns the grammar backend and, when
``GrammarConfig.mask_build_workers > 0``, the :class:`MaskWorkerPool`. Everything about *how*
the grammar work is served is decided here, not in the step: the tree walks run in this
process or in the worker processes; the workers' mirror matchers stand in for the host
matchers (the grammar barrier, for host and device trees) or not; the verdicts predicted from the new ids
are applied as a build is sent and checked when the walks arrive; a failed pool is dropped
and the host matchers replay what the mirrors had advanced. A request whose grammar has not
reached its worker yet (:meth:`MaskWorkerPool.ready`: grammars are shipped off the step loop)
is served in this process meanwhile: its host matcher takes its barrier and walks its tree
while the workers walk the others'. The verify step sees four calls:
:meth:`~GrammarService.stage_tree` (before the launch), :meth:`~GrammarService.plan_step`
(a :class:`GrammarPlan`), :meth:`~GrammarService.advance_previous` (the barrier) and
:meth:`~GrammarService.build_mask` (barrier, then the bitmask, queued to the device).
Every committed id is advanced exactly once (docs/architecture.md, invariant 3).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xgrammar as xgr

from structspec.constraints import GrammarConstraint
from structspec.core import FinishReason
from structspec.draft_tree.layout import VerifyTree
from structspec.grammar.backend import GrammarBackend, GrammarFuture
from structspec.grammar.llg_matcher import LlgCompiled
from structspec.grammar.matchers import AnyMatcher
from structspec.grammar.select_backend import AutoFuture, SelectingBackend
from structspec.grammar.tree_mask import (
    GrammarMaskResult,
    GrammarTree,
    build_grammar_vocab_mask,
    build_grammar_vocab_mask_pooled,
)
from structspec.grammar.worker_pool import (
    MaskPoolError,
    MaskWorkerPool,
    PoolBuildResult,
    PoolRequest,
)
from structspec.scheduler.commit import advance_grammar, cut_output, settle_grammar_advance
from structspec.scheduler.logprobs import trim_logprobs
from structspec.scheduler.request import Req
from structspec.scheduler.step_stats import StepTimer

logger = logging.getLogger(__name__)

#: failed worker pools replaced in the background per engine; after that the grammar work
#: stays in the engine process (a pool that keeps dying would only cost restarts)
MAX_POOL_RESPAWNS = 3

#: seconds :meth:`GrammarService.close` waits for a replacement pool still starting
RESPAWN_CLOSE_WAIT_S = 30.0


@dataclass(frozen=True)
class GrammarPlan:
    """How one verify step's grammar barrier is served, decided once per step over the batch
    and the previous step's requests that left it (:meth:`GrammarService.plan_step`).

    Attributes:
        previous: the previous step's requests, whose committed ids the barrier advances.
        barrier_in_workers: the mask workers' mirror matchers advance the grammar state of
            the batch's requests on the workers and of ``extra``: the previous step's text
            work may run while they advance and walk.
        extra: previous-step requests that left the batch, advanced in the workers in the
            same round trip (empty unless ``barrier_in_workers``).
        host_advance: with ``barrier_in_workers``, the previous step's requests whose grammar
            is not on their worker yet: the host matchers advance them (empty otherwise).
        poll_walks: when the workers serve the barrier, a non-blocking check whether every
            walk of the build in progress has arrived; None otherwise.
    """

    previous: tuple[Req, ...]
    barrier_in_workers: bool
    extra: tuple[Req, ...]
    poll_walks: Callable[[], bool] | None
    host_advance: tuple[Req, ...] = ()


class GrammarService:
    """Grammar compile, grammar barrier and tree bitmask for the scheduler (module doc).

    Args:
        backend: grammar backend for this model's tokenizer.
        device: where the verify logits live (the bitmask is uploaded there).
        vocab_size: the logits width.
        timer: the scheduler's step timer (phase ``mask`` and the pool's timings).
        live_requests: the requests whose host matchers replay their mirrors' lead when the
            pool is dropped (the scheduler's running and deferred requests).
        pool: the tree-bitmask worker pool, or None (walk in this process).
    """

    def __init__(self, backend: GrammarBackend | SelectingBackend, *, device: torch.device, vocab_size: int,
                 timer: StepTimer,
                 live_requests: Callable[[], Sequence[Req]],
                 pool: MaskWorkerPool | None = None) -> None:
        self.backend = backend
        self.pool = pool
        self._device = device
        self._vocab_size = vocab_size
        self._timer = timer
        self._live_requests = live_requests
        #: worker pools replaced so far after a failure
        self.num_respawns = 0
        #: deferred builds whose rows this process rebuilt after a worker failed
        #: (:meth:`_complete_deferred`)
        self.num_gate_failovers = 0
        self._respawn: Future[MaskWorkerPool] | None = None
        # request id -> :meth:`_pool_request`'s answer (what the pool needs of the request, or
        # None when it is not on a worker), asked up to three times per request and step (the
        # plan, the batch's split, the pool requests): it changes only when plan_step collects
        # shipments (dropped then), when the pool changes (dropped) and when the request is
        # released (its entry dropped). The PoolRequest holds the request's own output list
        # (only ever appended to or cut in place), so one object serves every step.
        self._on_worker_memo: dict[str, PoolRequest | None] = {}

    # ------------------------------------------------------------------ requests

    def submit(self, constraint: GrammarConstraint) -> GrammarFuture | AutoFuture:
        """Start compiling a request's grammar (never awaited here)."""
        return self.backend.submit(constraint)

    def create_matcher(self, compiled: xgr.CompiledGrammar | LlgCompiled) -> AnyMatcher:
        """A fresh matcher for a compiled grammar."""
        return self.backend.create_matcher(compiled)

    def prepare(self, req: Req) -> None:
        """A constrained request's grammar just compiled: with a worker pool, place the
        request and start shipping its grammar to its worker now, in the background, so that
        it is there by the time the request runs (never blocks)."""
        if self.pool is not None and req.matcher is not None \
                and self.pool.serves(req.matcher.compiled):
            self.pool.ready(req.request_id, req.matcher.compiled)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its mirror matcher, if any)."""
        self._on_worker_memo.pop(request_id, None)
        if self.pool is not None:
            self.pool.release(request_id)

    def close(self) -> None:
        """Stop the worker processes (freeing their shared memory), then the compile
        threads. Idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        respawn, self._respawn = self._respawn, None
        if respawn is not None:  # a replacement on its way is closed once it is there
            respawn.add_done_callback(
                lambda f: f.exception() is None and f.result().close())  # type: ignore[func-returns-value]
            # ... which is soon (a pool starts in seconds): wait for it here, so a process
            # that exits right after close() does not leave its shared memory to the resource
            # tracker (the start runs in a daemon thread, cut off at exit)
            with contextlib.suppress(Exception):
                respawn.result(timeout=RESPAWN_CLOSE_WAIT_S)
        self.backend.shutdown()

    # ------------------------------------------------------------------ one step

    def stage_tree(self, reqs: Sequence[Req], tree: VerifyTree) -> GrammarTree | None:
        """Stage the tree for the host-side mask build, *before* the verify launch: a device
        tree's D2H copies are queued right behind the draft kernels (with an event); a host
        tree needs no copy. None when no request of the batch is constrained."""
        if all(r.matcher is None for r in reqs):
            return None
        if tree.device.type == "cpu":
            return GrammarTree.from_host(tree.next_token, tree.next_sibling, tree.draft_tokens,
                                         tree.parents)
        if tree.host_links is not None:  # a propose graph's packed links: one copy
            return GrammarTree.from_links(tree.host_links, tree.batch_size)
        return GrammarTree.from_device(tree.next_token, tree.next_sibling, tree.draft_tokens,
                                       tree.parents)

    def plan_step(self, reqs: Sequence[Req], previous: Sequence[Req]) -> GrammarPlan:
        """Decide, once per verify step, who advances the grammar over ``previous``'s
        committed ids: with mirror matchers (worker pool) the pool's build advances
        the batch and the previous step's requests that left it in the same round trip; the
        verdicts predicted from the new ids are applied as the build is sent (the mirrors' own
        arrive with the walks and check them). Decided over the batch and those that left it
        (a lagging one among them must advance in its mirror too)."""
        if self.pool is None and self._respawn is not None and self._respawn.done():
            self._adopt_replacement()
        if self.pool is not None:
            try:  # grammars that reached their workers since the last step
                if self.pool.collect_shipped():
                    self._on_worker_memo.clear()
            except MaskPoolError as e:
                self._drop_pool(self.pool, e)
        in_batch = set(map(id, reqs))
        left = [r for r in previous if id(r) not in in_batch]
        pool = self.pool
        if pool is None or not self._mirrors_serve([*reqs, *left]):
            return GrammarPlan(previous=tuple(previous), barrier_in_workers=False, extra=(),
                               poll_walks=None)
        return GrammarPlan(previous=tuple(previous), barrier_in_workers=True,
                           extra=tuple(r for r in left if self._on_worker(r)),
                           poll_walks=pool.walks_ready,
                           host_advance=tuple(
                               r for r, q in zip(previous, self._pool_requests(previous),
                                                 strict=True) if q is None))

    def advance_previous(self, plan: GrammarPlan, *, in_mask_build: bool) -> None:
        """The grammar barrier of a verify step over ``plan.previous``: on the host matchers,
        unless the mirrors serve it (then a mask build advances them, or, when the step builds
        no mask, a mirror-only round trip)."""
        if not plan.barrier_in_workers:  # no request lags its mirror: host advance
            for req in plan.previous:
                advance_grammar(req)
        elif in_mask_build:  # the build advances the mirrors; the rest advance here
            for req in plan.host_advance:
                advance_grammar(req)
        else:  # no request of the batch is constrained: no mask build, so
            self.barrier(list(plan.previous))  # the mirrors advance on their own

    def barrier(self, reqs: Sequence[Req]) -> None:
        """Advance every request's grammar state over its committed-but-unadvanced ids
        (exactly once): in the worker pool's mirrors when they stand in for the host
        matchers (:meth:`_mirrors_serve`), else on the host matchers."""
        if self._mirrors_serve(reqs):
            pool = self.pool
            assert pool is not None
            try:
                self._apply_verdicts(reqs, pool.advance(self._pool_requests(reqs)))
                for req in reqs:  # the requests whose grammar is not on a worker yet
                    if not self._on_worker(req):
                        advance_grammar(req)
                return
            except MaskPoolError as e:  # the host matchers replay the mirrors' share below
                self._drop_pool(pool, e)
        for req in reqs:
            advance_grammar(req)

    def build_mask(self, reqs: Sequence[Req], gtree: GrammarTree, *,
                   plan: GrammarPlan | None, while_walking: Callable[[], None] | None,
                   out: torch.Tensor | None = None,
                   pool_requests: list[PoolRequest | None] | None = None,
                   while_drafting: Callable[[Callable[[], bool]], None] | None = None,
                   defer: bool = False,
                   ) -> GrammarMaskResult | None:
        """Barrier, then the tree bitmask (queued to the device ``non_blocking``, into ``out``
        when given); the tree walks run in the worker pool when there is one and the batch
        has at least as many constrained requests as it has workers, or when ``plan`` says
        the mirrors serve the barrier.

        ``while_walking`` (the step's barrier and the previous step's text work) runs before
        the walks in process, or while the workers walk. With mirrors, the verdicts predicted
        from the new ids are applied as soon as the build is sent, before ``while_walking``;
        a mirror's verdict that contradicts its prediction ends that request
        (:meth:`_settle_mismatches`). ``plan`` None: a prefill (no barrier, no mirrors).
        ``pool_requests``: :meth:`pool_walks` of the same requests and plan in this step,
        when the caller asked already (else computed here). ``while_drafting``: with mirrors
        and a device tree, work run after the predicted verdicts while the tree is still on
        its way, called with a predicate that turns true once it has arrived
        (:func:`~structspec.grammar.tree_mask.build_grammar_vocab_mask_pooled`).
        ``defer``: a pool build with a device gate returns before the workers' replies, its
        upload queued behind device-side waits on their flags; the caller must call the
        result's :meth:`~structspec.grammar.tree_mask.GrammarMaskResult.complete` before the
        step's commit (it reads the replies, checks the verdicts and, when a worker failed,
        writes the rows from this process's matchers before the device reads them:
        :meth:`_complete_deferred`).
        """
        mirrors = plan is not None and plan.barrier_in_workers
        mirror_extra = plan.extra if plan is not None else ()
        matchers = [r.matcher for r in reqs]
        pool = self.pool
        requests = pool_requests if pool_requests is not None else self._pool_requests(reqs)
        if pool is not None and self._pool_builds(requests, plan):
            extra = [r for r in mirror_extra if r.matcher is not None]
            try:
                mask = build_grammar_vocab_mask_pooled(
                    pool, requests, matchers, gtree, device=self._device,
                    barrier=while_walking, out=out,
                    local=[b for b, (r, q) in enumerate(zip(reqs, requests, strict=True))
                           if r.matcher is not None and q is None],
                    advance_only=[q for q in self._pool_requests(extra) if q is not None],
                    on_verdicts=(lambda res: self._apply_verdicts([*reqs, *extra], res))
                    if mirrors else None, while_drafting=while_drafting, defer=defer)
                if mask is not None and mask.pending is not None:
                    read_replies = mask.pending
                    mask.pending = lambda: self._complete_deferred(
                        mask, read_replies, pool, reqs, extra, gtree, mirrors)
                elif mask is not None and mask.mirror is not None:
                    mirror = mask.mirror
                    self._timer.pool(mirror.send_ms, mirror.worker_busy_ms,
                                     first_start_ms=mirror.first_start_ms,
                                     last_reply_ms=mirror.last_reply_ms,
                                     read_ms=mirror.read_ms)
                    if mirrors:
                        self._settle_mismatches([*reqs, *extra], mask.mirror.mismatched)
                self._timer.phase("mask")
                return mask
            except MaskPoolError as e:
                # Drop the pool and build in process: the host matchers replay whatever the
                # mirrors had advanced (or apply what they had not; ``_drop_pool`` covers the
                # running requests, ``extra`` left them), then ``while_walking`` runs again
                # (the grammar advance and the text work are idempotent).
                self._drop_pool(pool, e)
                for req in extra:
                    advance_grammar(req)

        def barrier_then_catch_up() -> None:
            if while_walking is not None:
                while_walking()
            # An in-process walk starts from the host matchers: replay any lag behind a mirror
            # (those ids already had the mirror's verdict, so nothing is dropped here).
            for req in reqs:
                advance_grammar(req)

        mask = build_grammar_vocab_mask(matchers, gtree, vocab_size=self._vocab_size,
                                        device=self._device, barrier=barrier_then_catch_up,
                                        out=out)
        self._timer.phase("mask")
        return mask

    def _complete_deferred(self, mask: GrammarMaskResult, read_replies: Callable[[], None],
                           pool: MaskWorkerPool, reqs: Sequence[Req], extra: Sequence[Req],
                           gtree: GrammarTree, mirrors: bool) -> None:
        """The end of a deferred pool build (:meth:`build_mask` with ``defer``): read the
        replies, then what :meth:`build_mask` does after a pool build (the pool's timings,
        the mirrors' verdicts checked) and count the drafts the grammar rejected.

        When a worker died or failed, its flag is never stored and the device waits before
        the upload: the pool's workers are stopped, this process's matchers catch up and
        write every row and cap of the batch into the segment, the flags are released and
        the device drains before the segment is freed (:meth:`_drop_pool`'s ``before_free``).
        Should that build fail too, the flags are released all the same and the batch's
        constrained requests end with an error before anything is committed: no token
        chosen under a mask that was never built is emitted."""
        try:
            read_replies()
        except MaskPoolError as e:
            gate = mask.gate
            assert gate is not None
            rebuilt: list[bool] = []

            def rebuild_rows() -> None:
                try:
                    for req in reqs:  # the host matchers replay the mirrors' lead
                        advance_grammar(req)
                    if gate.flags_set():
                        # every worker stored its flag (the failed one died after it): the
                        # device may be copying their complete rows now; it keeps them
                        rebuilt.append(True)
                        return
                    host = build_grammar_vocab_mask([r.matcher for r in reqs], gtree,
                                                    vocab_size=self._vocab_size, device="cpu")
                    if host is not None:
                        gate.rows.copy_(host.bitmask_cpu)
                        gate.caps.copy_(host.max_accept_cpu)
                        mask.truncated_requests = host.truncated_requests
                        mask.rejected_by_grammar[:] = host.rejected_by_grammar
                    rebuilt.append(True)
                finally:
                    gate.release()

            self.num_gate_failovers += 1
            self._drop_pool(pool, e, before_free=rebuild_rows)
            for extra_req in extra:
                advance_grammar(extra_req)
            if not rebuilt:
                logger.error("the grammar mask of a verify step could not be rebuilt after the "
                             "mask worker pool failed; its constrained requests end")
                for req in reqs:
                    if req.matcher is not None and not req.finished:
                        req.finish(FinishReason.ABORT, force=True,
                                   error="the grammar mask could not be built")
                        trim_logprobs(req)
        else:
            mirror = mask.mirror
            assert mirror is not None
            self._timer.pool(mirror.send_ms, mirror.worker_busy_ms,
                             first_start_ms=mirror.first_start_ms,
                             last_reply_ms=mirror.last_reply_ms, read_ms=mirror.read_ms)
            if mirrors:
                self._settle_mismatches([*reqs, *extra], mirror.mismatched)
        for req, rejected in zip(reqs, mask.rejected_by_grammar, strict=True):
            req.spec.draft_tokens_rejected_by_grammar += rejected

    def pool_walks(self, reqs: Sequence[Req],
                   plan: GrammarPlan | None) -> list[PoolRequest | None] | None:
        """What the worker pool would walk for these requests (pass it to :meth:`build_mask`
        as ``pool_requests``), or None when :meth:`build_mask` would walk them in process
        (the same rule; a pool that then fails still falls back in process)."""
        if self.pool is None:
            return None
        requests = self._pool_requests(reqs)
        return requests if self._pool_builds(requests, plan) else None

    # ------------------------------------------------------------------ mirrors and pool

    def _pool_builds(self, requests: Sequence[PoolRequest | None],
                     plan: GrammarPlan | None) -> bool:
        """The pool builds the mask when the mirrors serve the barrier, or when the batch has
        at least as many requests on the workers as there are workers (below that the round
        trip costs more than the walks it spreads)."""
        pool = self.pool
        return pool is not None and ((plan is not None and plan.barrier_in_workers)
                                     or sum(q is not None for q in requests) >= pool.num_workers)

    def _mirrors_serve(self, reqs: Sequence[Req]) -> bool:
        """Whether the worker pool's mirror matchers advance these requests' grammar state
        (the barrier) in place of the host matchers.

        For host trees (n-gram) and device trees (EAGLE, draft model) alike. A device tree's
        barrier used to stay in this process, on the reasoning that it hides in the wait for
        the drafted tree; on the H200 the tree has reached the host by the time the verify is
        launched at batch 8-64 (2026-12-03, `grammar_overlap.py --algorithms eagle`), so the
        barrier (0.2 ms at batch 8, 0.9 ms at 64) lengthened the step's host path, while the
        workers split it. The pool serves a batch with at least as many constrained requests
        on the workers (:meth:`_on_worker`) as it has workers (below that its round trip
        costs more than it saves), and any batch holding a request whose host matcher lags its
        mirror (a host replay of that lag would stall the step).
        """
        pool = self.pool
        if pool is None:
            return False
        constrained = [r for r, q in zip(reqs, self._pool_requests(reqs), strict=True)
                       if q is not None]
        if not constrained:
            return False
        return len(constrained) >= pool.num_workers or any(
            pool.num_synced(r.request_id) > r.num_grammar_advanced for r in constrained)

    def _drop_pool(self, pool: MaskWorkerPool, error: MaskPoolError,
                   before_free: Callable[[], None] | None = None) -> None:
        """A worker died or failed: serve the grammar in this process from now on (the
        live requests' host matchers replay what their mirrors had advanced).
        ``before_free``: see :meth:`MaskWorkerPool.close`."""
        respawn = self.num_respawns < MAX_POOL_RESPAWNS
        logger.error("grammar mask worker pool failed (%s); the engine process does the grammar "
                     "work %s", error, "until a new pool has started" if respawn else
                     "from now on")
        self.pool = None
        self._on_worker_memo.clear()
        pool.close(before_free)
        for req in self._live_requests():  # replay every mirror's lead now
            advance_grammar(req)
        if respawn:  # started off the step loop; adopted by plan_step once it is up
            self.num_respawns += 1
            future: Future[MaskWorkerPool] = Future()

            def start() -> None:
                try:
                    future.set_result(pool.replacement())
                except Exception as e:  # noqa: BLE001 - reported by _adopt_replacement
                    future.set_exception(e)

            self._respawn = future
            threading.Thread(target=start, name="mask-pool-respawn", daemon=True).start()

    def _adopt_replacement(self) -> None:
        """Take the pool started after a failure (every request starts on it afresh: placed
        and shipped on first sight, served here meanwhile), or log why there is none."""
        respawn, self._respawn = self._respawn, None
        assert respawn is not None
        self._on_worker_memo.clear()
        try:
            self.pool = respawn.result()
        except Exception as e:  # noqa: BLE001 - the engine keeps the grammar work in process
            logger.error("grammar mask worker pool could not be restarted (%s); the engine "
                         "process does the grammar work from now on", e)
            return
        logger.warning("grammar mask worker pool restarted (%d of at most %d restarts)",
                       self.num_respawns, MAX_POOL_RESPAWNS)
        for req in self._live_requests():  # each request is placed on the new pool
            self._on_worker(req)

    def _on_worker(self, req: Req) -> bool:
        """Whether the pool can serve ``req`` now: constrained, and its grammar is loaded on
        its worker (placing it and starting the shipment on first sight). Changes only when
        :meth:`plan_step` collects the shipments, so one step sees one answer."""
        return self._pool_request(req) is not None

    def _pool_request(self, req: Req) -> PoolRequest | None:
        """What the pool needs of ``req``, or None: no pool, unconstrained, or its grammar is
        not on its worker yet (then this process serves it). Memoized per request id (see
        ``_on_worker_memo``)."""
        pool, memo, rid = self.pool, self._on_worker_memo, req.request_id
        if pool is None:  # none, or closed (close() leaves the memo)
            return None
        if rid in memo:
            return memo[rid]
        matcher = req.matcher
        if matcher is None:
            return None
        # a grammar of a backend the workers were not started for stays in this process, as
        # local rows of the same build
        known = (PoolRequest(rid, matcher.compiled, req.output_ids)
                 if pool.serves(matcher.compiled) and pool.ready(rid, matcher.compiled)
                 else None)
        memo[rid] = known
        return known

    def _pool_requests(self, reqs: Sequence[Req]) -> list[PoolRequest | None]:
        """Per request, what the pool needs, or None: unconstrained, or its grammar is not on
        its worker yet (then this process serves it)."""
        if self.pool is None:
            return [None] * len(reqs)
        memo = self._on_worker_memo
        # the memo's hits inline (one dict probe per request: this runs for the whole batch
        # every step); a miss asks the pool once
        return [memo[r.request_id] if r.request_id in memo else self._pool_request(r)
                for r in reqs]

    @staticmethod
    def _apply_verdicts(reqs: Sequence[Req], result: PoolBuildResult) -> None:
        """Apply the mirrors' verdicts (ids not kept, grammar ended; actual or predicted, see
        ``MaskWorkerPool.build``) to ``reqs`` (indexed as the pool saw them); the host
        matchers lag and replay only when needed."""
        terminated = set(result.terminated)
        for b in sorted(terminated | result.rejected.keys()):
            settle_grammar_advance(reqs[b], result.rejected.get(b, 0), b in terminated)

    @staticmethod
    def _settle_mismatches(reqs: Sequence[Req],
                           mismatched: dict[int, tuple[int, int, bool]]) -> None:
        """End the requests whose mirror refused committed ids that the predicted verdict kept
        (indexed as the pool saw them; see ``PoolBuildResult.mismatched``).

        Committed ids are chosen under the grammar's mask, so this happens only when the
        grammar engine's mask and its matcher disagree. The request ends with an error, as
        the host matcher's barrier would end it, and the refused ids are cut before anything
        is reported: outputs are collected at the end of the step, after this. Their text,
        which the step's text work may already have made, is rebuilt from the kept ids.
        """
        for b, (sent, rejected, _ended) in sorted(mismatched.items()):
            req = reqs[b]
            keep = min(len(req.output_ids), sent - rejected)
            first = req.output_ids[keep] if keep < len(req.output_ids) else None
            logger.error("request %s: the grammar mirror refused %d committed id(s) that the "
                         "mask had allowed (first: %s)", req.request_id, rejected, first)
            cut = cut_output(req, keep)
            if not cut and req.finished:
                # A stop string already cut the refused ids and ended the request; it wins,
                # as it does when the text work runs after this (its finish is forced).
                continue
            req.finish(FinishReason.ABORT, force=True, error=(
                f"grammar rejected token {first} after {keep} output tokens" if cut else
                "the grammar state diverged from the committed tokens"))
            trim_logprobs(req)
