"""Continuous-batching scheduler: admission, prefill and speculative verify steps.

This is the only module that knows both :mod:`structspec.grammar` and :mod:`structspec.speculative`.
One decode step (DESIGN.md "One speculative step with a grammar"):

1. the drafter proposes a :class:`VerifyTree` per running request;
2. the tree is staged for the host (``GrammarTree.from_host`` / ``from_device``) *before*
   the verify launch;
3. the target verify forward is launched;
4. while it runs, the grammar bitmask is built over the tree and copied to the device;
5. the mask is applied to all ``[B * N, V]`` rows, targets are chosen, the tree is verified,
   accepted KV is compacted;
6. accepted runs are committed (:mod:`structspec.scheduler.commit`), advancing each matcher
   exactly once per committed token.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import torch

from structspec.config import EngineConfig
from structspec.core import FinishReason, RequestOutput, TokenLogprob, now
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.verify import verify_tree
from structspec.grammar.backend import GrammarBackend
from structspec.grammar.bitmask import apply_bitmask_
from structspec.grammar.errors import GrammarError
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
from structspec.kvcache.allocator import PageAllocator
from structspec.layers.sampler import SamplingBatch, sample_rows
from structspec.runner.model_runner import ModelRunner, VerifyForwardOutput
from structspec.scheduler.commit import (
    advance_grammar,
    commit_tokens,
    cut_output,
    process_text,
    settle_grammar_advance,
)
from structspec.scheduler.pending import PendingStep
from structspec.scheduler.request import Req, ReqStatus
from structspec.scheduler.step_stats import StepTimer
from structspec.scheduler.validate import check_schema_output
from structspec.speculative.base import Drafter, DraftRequest, TokenHistory
from structspec.staging import stack_to_device, to_device

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns every live request and decides what runs each step.

    Args:
        config: the resolved engine config.
        runner: target model runner (owns the KV pool).
        grammar: grammar backend for this model's tokenizer.
        drafter: the speculative drafter (``NoDrafter`` for plain decoding).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        grammar: GrammarBackend,
        drafter: Drafter,
    ) -> None:
        self.config = config
        self.runner = runner
        self.grammar = grammar
        self.drafter = drafter
        self.num_nodes = drafter.num_nodes
        # EAGLE heads read target features: the target forwards must return them.
        runner.aux_hidden_layers = tuple(getattr(drafter, "aux_hidden_layers", ()))
        self._feeds_hidden = hasattr(drafter, "on_target_hidden")
        self.allocator = PageAllocator(runner.kv_pool.num_pages, runner.page_size)
        self.requests: dict[str, Req] = {}
        self.grammar_queue: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._finished_unreported: list[Req] = []
        self._deferred: list[Req] = []  # committed ids whose grammar/text work is pending
        self._touched: list[Req] = []  # requests whose progress the next output reports
        self._engine_generator = torch.Generator(device=runner.device)
        self._engine_generator.manual_seed(config.seed)
        #: worker processes for the tree bitmask (set by the engine when
        #: ``GrammarConfig.mask_build_workers > 0``); None = walk in this process
        self.mask_pool: MaskWorkerPool | None = None
        #: per verify step CPU phase / GPU busy and idle times (see step_stats.py)
        self.timer = StepTimer(runner.device)
        self._pinned_pool: dict[tuple, torch.Tensor] = {}  # D2H buffers of PendingStep

    # ------------------------------------------------------------------ queue management

    @property
    def num_unfinished(self) -> int:
        return len(self.grammar_queue) + len(self.waiting) + len(self.running)

    def kv_tokens_needed(self, req: Req) -> int:
        """KV slots reserved for ``req``: prompt, every new token, and one tree of scratch."""
        return len(req.prompt_ids) + req.max_new_tokens + self.num_nodes

    def add(self, req: Req) -> None:
        """Queue a validated request (grammar compile is started here, never awaited).

        Raises:
            ValueError: when the request can never fit in the KV cache.
        """
        need_pages = self.allocator.pages_for(self.kv_tokens_needed(req))
        if need_pages > self.allocator.num_pages - 1:
            raise ValueError(
                f"request needs {self.kv_tokens_needed(req)} KV slots (prompt + max_tokens + "
                f"draft tree) but the cache holds {self.allocator.capacity_tokens}; lower "
                "max_tokens or raise the KV capacity"
            )
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        # What can raise runs before the request is registered (a failed add leaves nothing
        # behind, so its id can be used again).
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device)
            req.generator.manual_seed(req.params.seed)
        if req.params.grammar is not None:
            req.grammar_future = self.grammar.submit(req.params.grammar)
        self.requests[req.request_id] = req
        if req.grammar_future is not None:
            req.status = ReqStatus.WAITING_GRAMMAR
            self.grammar_queue.append(req)
        else:
            req.status = ReqStatus.WAITING
            self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "aborted by client") -> bool:
        """End a request now; frees its KV. Returns False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.finish(FinishReason.ABORT, error=reason)
        self._retire(req)
        return True

    def _retire(self, req: Req) -> None:
        """Remove a finished request from the queues and free what it holds (once)."""
        if req.finish_time is not None:
            return  # already retired (e.g. aborted while its last step was deferred)
        if req in self.running:
            self.running.remove(req)
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        self.drafter.release(req.request_id)
        if self.mask_pool is not None:
            self.mask_pool.release(req.request_id)
        req.finish_time = now()
        req.matcher = None
        if req.params.grammar is not None and req.finish_reason is FinishReason.STOP:
            req.schema_valid = check_schema_output(req.params.grammar, req.text)
        self._finished_unreported.append(req)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step (a prefill or a verify forward) and report progress.

        With ``SchedulerConfig.overlap`` the text processing (detokenization, stop strings,
        outputs) and the grammar advance of step k run after step k+1's verify launch, under
        the GPU forward; without it they run before. Outputs are identical either way.

        Returns:
            One output per request that gained tokens or finished since the last step.
        """
        self._poll_grammar()
        batch = self._admit()
        if batch:
            self._finish_deferred()
            self._run_prefill(batch)
        elif any(not r.finished for r in self.running):
            self._run_verify([r for r in self.running if not r.finished])
        else:
            self._finish_deferred()
        return self._collect_outputs()

    def _collect_outputs(self) -> list[RequestOutput]:
        t = now()
        outputs = []
        deferred = set(map(id, self._deferred))
        for req in self._touched:
            if req.finished and req not in self._finished_unreported:
                if id(req) in deferred:
                    continue  # its last run's text/grammar work is still pending
                self._retire(req)
            elif not req.finished and req.num_reported_ids < req.num_detokenized:
                outputs.append(req.take_output(t))
        self._touched = []
        for req in self._finished_unreported:
            outputs.append(req.take_output(t))
            self.requests.pop(req.request_id, None)
        self._finished_unreported = []
        return outputs

    def _grammar_barrier(self, reqs: Sequence[Req]) -> None:
        """Advance every request's grammar state over its committed-but-unadvanced ids
        (exactly once): in the worker pool's mirrors when they stand in for the host
        matchers (:meth:`_mirrors_serve`), else on the host matchers."""
        if self._mirrors_serve(reqs):
            pool = self.mask_pool
            assert pool is not None
            try:
                self._apply_verdicts(reqs, pool.advance(self._pool_requests(reqs)))
                return
            except MaskPoolError as e:  # the host matchers replay the mirrors' share below
                self._drop_pool(pool, e)
        for req in reqs:
            advance_grammar(req)

    def _mirrors_serve(self, reqs: Sequence[Req]) -> bool:
        """Whether the worker pool's mirror matchers advance these requests' grammar state
        (the barrier) in place of the host matchers.

        Only for host trees (n-gram): a device tree's barrier already hides in the wait for
        the drafted tree. The pool serves a batch with at least as many constrained requests
        as it has workers (below that its round trip costs more than it saves), and any batch
        holding a request whose host matcher lags its mirror (a host replay of that lag would
        stall the step).
        """
        pool = self.mask_pool
        if pool is None or not self.drafter.tree_on_host:
            return False
        constrained = [r for r in reqs if r.matcher is not None]
        if not constrained:
            return False
        return len(constrained) >= pool.num_workers or any(
            pool.num_synced(r.request_id) > r.num_grammar_advanced for r in constrained)

    def _drop_pool(self, pool: MaskWorkerPool, error: MaskPoolError) -> None:
        """A worker died or failed: serve the grammar in this process from now on (the
        running requests' host matchers replay what their mirrors had advanced)."""
        logger.error("grammar mask worker pool failed (%s); the engine process does the grammar "
                     "work from now on", error)
        self.mask_pool = None
        pool.close()
        for req in [*self.running, *self._deferred]:  # replay every mirror's lead now
            advance_grammar(req)

    @staticmethod
    def _pool_requests(reqs: Sequence[Req]) -> list[PoolRequest | None]:
        return [None if r.matcher is None else
                PoolRequest(r.request_id, r.matcher.compiled, r.output_ids) for r in reqs]

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
            _trim_logprobs(req)

    def _finish_deferred(self) -> None:
        """Run the grammar advance and text processing a previous step deferred."""
        deferred, self._deferred = self._deferred, []
        self._grammar_barrier(deferred)
        self.timer.phase("barrier")
        for req in deferred:
            process_text(req)
            _trim_logprobs(req)  # the barrier or a stop string may have dropped ids
        self._touched.extend(deferred)
        self.timer.phase("text")

    def _poll_grammar(self) -> None:
        t = now()
        for req in list(self.grammar_queue):
            fut = req.grammar_future
            assert fut is not None
            if not fut.done() and not fut.expired(t):
                continue
            self.grammar_queue.remove(req)
            try:
                compiled = fut.result(timeout=0)
                req.matcher = self.grammar.create_matcher(compiled)
            except GrammarError as e:
                req.finish(FinishReason.ABORT, error=str(e), error_param=e.param)
                self._retire(req)
                continue
            req.grammar_future = None
            req.status = ReqStatus.WAITING
            self.waiting.append(req)

    def _admit(self) -> list[Req]:
        """Pick waiting requests for one prefill step (FCFS; stops at the first that won't fit)."""
        cfg = self.config.scheduler
        batch: list[Req] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < cfg.max_batch_size:
            req = self.waiting[0]
            plen = len(req.prompt_ids)
            if batch and tokens + plen > cfg.max_prefill_tokens:
                break
            need = self.allocator.pages_for(self.kv_tokens_needed(req))
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            req.status = ReqStatus.RUNNING
            batch.append(req)
            tokens += plen
        return batch

    # ------------------------------------------------------------------ prefill

    def _run_prefill(self, batch: list[Req]) -> None:
        self.timer.break_chain()
        out = self.runner.prefill([r.prompt_ids for r in batch], [r.pages for r in batch])
        if self._feeds_hidden:
            self.drafter.on_target_hidden(  # type: ignore[attr-defined]
                [DraftRequest(r.request_id, r.prompt_ids, 0) for r in batch],
                out.hidden_states, None, [len(r.prompt_ids) for r in batch],
                out.aux_hidden_states)
        for r in batch:
            r.seq_len = len(r.prompt_ids)
        tree = VerifyTree.root_only(torch.tensor([r.prompt_ids[-1] for r in batch]))
        gtree = self._stage_grammar_tree(batch, tree)
        step = self._select_and_verify(batch, tree, gtree, out.logits, barrier=None)
        runs = step.wait()
        t = now()
        for req, run in zip(batch, runs, strict=True):
            commit_tokens(req, run, t)
            advance_grammar(req)
            process_text(req)
            _trim_logprobs(req)
            self.running.append(req)
        self._touched.extend(batch)

    # ------------------------------------------------------------------ verify

    def _stage_grammar_tree(self, reqs: Sequence[Req], tree: VerifyTree) -> GrammarTree | None:
        """Stage the tree for the host-side mask build, *before* the verify launch: a device
        tree's D2H copies are queued right behind the draft kernels (pinned, non_blocking,
        with an event); a host tree needs no copy."""
        if all(r.matcher is None for r in reqs):
            return None
        if tree.device.type == "cpu":
            return GrammarTree.from_host(tree.next_token, tree.next_sibling, tree.draft_tokens,
                                         tree.parents)
        return GrammarTree.from_device(tree.next_token, tree.next_sibling, tree.draft_tokens,
                                       tree.parents)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Host tensor to the model device (pinned staging on CUDA; see :mod:`staging`)."""
        return to_device(host, self.runner.device, self.runner.staging)

    def _tree_to_device(self, tree: VerifyTree) -> VerifyTree:
        """A host tree on the model device: the five int64 fields in one staged copy, the bool
        ancestor mask in a second."""
        if tree.device == self.runner.device or tree.device.type != "cpu":
            return tree
        fields = ("draft_tokens", "parents", "depth", "next_token", "next_sibling")
        dev, staging = self.runner.device, self.runner.staging
        ints = stack_to_device([getattr(tree, f) for f in fields], dev, staging)
        return VerifyTree(**dict(zip(fields, ints, strict=True)),
                          ancestor_mask=to_device(tree.ancestor_mask, dev, staging))

    def _run_verify(self, reqs: list[Req]) -> None:
        timer = self.timer
        timer.begin(len(reqs), self.num_nodes, sum(r.matcher is not None for r in reqs))
        draft_reqs = [DraftRequest(r.request_id, TokenHistory(r.prompt_ids, r.output_ids),
                                   r.seq_len) for r in reqs]
        tree = self.drafter.propose(draft_reqs)
        timer.phase("draft")
        timer.event("fwd_start")
        gtree = self._stage_grammar_tree(reqs, tree)
        deferred, self._deferred = self._deferred, []

        # A device tree reaches the host only when the draft kernels finish; the mask build
        # blocks on that copy, so the previous step's text work goes first, into that wait.
        # A host tree is there already: its mask goes first (the forward is waiting for it).
        # With mirror matchers (worker pool, host tree) the pool's build advances this batch's
        # grammar state, and that of the previous step's requests that left the batch in the
        # same round trip; the verdicts predicted from the new ids are applied as the build
        # is sent (the mirrors' own arrive with the walks and check them), so the text work
        # runs while the workers advance and walk. Decided once per step, over the batch and
        # those that left it (a lagging one among them must advance in its mirror too).
        in_batch = set(map(id, reqs))
        left = [r for r in deferred if id(r) not in in_batch]
        mirrors = self._mirrors_serve([*reqs, *left])
        mirror_extra = left if mirrors else []
        text_first = not self.drafter.tree_on_host or mirrors
        text_todo = deque(deferred)  # previous-step requests whose text work has not run
        pool = self.mask_pool if mirrors else None

        def barrier() -> None:
            if not mirrors:  # no request lags its mirror (else ``mirrors``): host advance
                for req in deferred:
                    advance_grammar(req)
            elif gtree is None:  # no request of the batch is constrained: no mask build, so
                self._grammar_barrier(deferred)  # the mirrors advance on their own
            timer.phase("barrier")
            if text_first:
                # While the workers walk. Once every walk is in, the rest waits until the
                # mask is uploaded: the forward may be about to need it, and text work is
                # ~10 us per request against ~35 us per tree walk spread over the workers.
                # Polled at most every 40 us (a poll costs a few us).
                next_poll = 0.0
                while text_todo:
                    process_text(text_todo.popleft())
                    if pool is not None and text_todo and (t := now()) >= next_poll:
                        if pool.walks_ready():
                            break
                        next_poll = t + 40e-6
                timer.phase("text")

        early_mask: GrammarMaskResult | None = None
        if gtree is not None and not self.drafter.supports_grammar_overlap:
            # Synchronous fallback for drafters that cannot overlap: barrier and mask build
            # finish before the verify launch (the GPU idles meanwhile).
            early_mask = self._build_mask(reqs, gtree, barrier, mirror_extra=mirror_extra,
                                          mirrors=mirrors)
            barrier, gtree = None, None
        # A host tree goes to the runner as is: a graph replay stages it into the graph's
        # static inputs with one pinned copy; only the eager path needs a device copy.
        fwd = self.runner.verify(tree, [r.seq_len for r in reqs], [r.pages for r in reqs])
        timer.event("fwd_end")
        timer.phase("launch")
        # From here the GPU runs the verify forward; the CPU work below hides under it.
        step = self._select_and_verify(reqs, tree, gtree, fwd.logits, barrier=barrier,
                                       early_mask=early_mask, fwd=fwd, mirrors=mirrors,
                                       mirror_extra=mirror_extra)
        timer.event("end")
        timer.phase("launch")
        while text_todo:  # the previous step's text work left, still under the GPU step
            process_text(text_todo.popleft())
        for req in deferred:  # the barrier or a stop string may have dropped ids
            _trim_logprobs(req)
        self._touched.extend(deferred)
        timer.phase("text")
        runs = step.wait()  # the one planned host wait of the step
        timer.phase("wait")
        if self._feeds_hidden:
            # Features of node 0 and the accepted drafts (the bonus has no KV yet).
            self.drafter.on_target_hidden(  # type: ignore[attr-defined]
                draft_reqs, fwd.hidden_states, step.result.accept_nodes,
                [len(r) for r in runs], fwd.aux_hidden_states)
        t = now()
        committed: list[list[int]] = []
        num_real = step.num_real_drafts
        for i, (req, run) in enumerate(zip(reqs, runs, strict=True)):
            if req.finished:  # ended by a stop string found after this step was launched
                committed.append([])
                continue
            req.spec.verify_steps += 1
            req.spec.draft_tokens_proposed += num_real[i]
            req.spec.draft_tokens_accepted += len(run) - 1
            kept = commit_tokens(req, run, t)
            req.spec.committed_tokens += len(kept)
            req.seq_len += len(run)
            committed.append(kept)
        self.drafter.on_verified(draft_reqs, committed)
        for req in reqs:
            if req.finished:
                self.drafter.release(req.request_id)
        timer.phase("commit")
        self._deferred = reqs
        if not self.config.scheduler.overlap:
            self._finish_deferred()
        for req in reqs:
            _trim_logprobs(req)
        timer.end()

    def _select_and_verify(
        self,
        reqs: Sequence[Req],
        tree: VerifyTree,
        gtree: GrammarTree | None,
        logits: torch.Tensor,
        *,
        barrier: Callable[[], None] | None,
        early_mask: GrammarMaskResult | None = None,
        fwd: VerifyForwardOutput | None = None,
        mirrors: bool = False,
        mirror_extra: Sequence[Req] = (),
    ) -> PendingStep:
        """Mask, choose a target token per node row, verify the trees, compact the accepted
        KV (verify steps); start the D2H copy.

        ``barrier`` runs first (it advances matchers over the previous step's ids); the mask
        is built after it, on the host, while the device still runs the forward.
        ``early_mask``: a mask already built before the launch (synchronous fallback).
        ``fwd``: the verify forward's output (None for a prefill, whose tree is the root
        only). ``mirrors`` / ``mirror_extra``: see :meth:`_build_mask`. A greedy batch whose
        forward was a CUDA-graph replay runs everything after the mask upload as one
        post-graph replay (:meth:`ModelRunner.greedy_verify`); other batches (sampling, eager
        forwards, prefill) run the same steps eagerly.
        """
        n = tree.num_nodes
        sb = self._sampling_batch(reqs, n, logits.device)
        graph_bitmask = None
        if fwd is not None and sb.all_greedy:
            graph_bitmask = self.runner.graph_bitmask(fwd)
        use_graph = graph_bitmask is not None
        mask = early_mask
        if gtree is not None:
            mask = self._build_mask(reqs, gtree, barrier, out=graph_bitmask, mirrors=mirrors,
                                    mirror_extra=mirror_extra)
        elif barrier is not None:
            barrier()
        self.timer.event("post")
        cap_cpu = None
        if mask is not None:
            if mask.truncated_requests:  # a tree walk timed out: bonus token only
                cap_cpu = mask.max_accept_cpu
            for req, rejected in zip(reqs, mask.rejected_by_grammar, strict=True):
                req.spec.draft_tokens_rejected_by_grammar += rejected
        if use_graph:
            assert fwd is not None and graph_bitmask is not None
            if mask is not None and mask.bitmask_device.data_ptr() != graph_bitmask.data_ptr():
                graph_bitmask[: mask.bitmask_device.shape[0]].copy_(mask.bitmask_device)
            result, num_real = self.runner.greedy_verify(fwd, masked=mask is not None,
                                                         max_accept_cpu=cap_cpu)
        else:
            tree_dev = self._tree_to_device(tree)
            if mask is not None:
                apply_bitmask_(logits, mask.bitmask_device)
            cap = None if cap_cpu is None else self._to_device(cap_cpu.to(torch.int64))
            targets = sample_rows(logits, sb).view(len(reqs), n)
            result = verify_tree(tree_dev, targets, cap)
            num_real = (tree_dev.draft_tokens[:, 1:] >= 0).sum(dim=1)
            if fwd is not None:
                self.runner.commit_accepted_kv(fwd, result)
        step = PendingStep.launch(result, num_real, self._pinned_pool)
        if any(r.params.logprobs is not None for r in reqs):
            step.on_wait = lambda runs: self._record_logprobs(
                reqs, logits.view(len(reqs), n, -1), result.accept_nodes, runs)
        return step

    def _build_mask(self, reqs: Sequence[Req], gtree: GrammarTree,
                    barrier: Callable[[], None] | None,
                    out: torch.Tensor | None = None, *, mirrors: bool = False,
                    mirror_extra: Sequence[Req] = ()) -> GrammarMaskResult | None:
        """Barrier, then the tree bitmask (queued to the device ``non_blocking``, into ``out``
        when given); the tree walks run in the worker pool when there is one and the batch has
        at least as many constrained requests as it has workers.

        ``mirrors``: the pool's mirror matchers are this step's grammar barrier for ``reqs``
        and ``mirror_extra`` (the previous step's requests that left the batch): the verdicts
        predicted from the new ids are applied as soon as the build is sent, before
        ``barrier`` (then the previous step's text work) runs while the workers advance and
        walk; a mirror's verdict that contradicts its prediction ends that request
        (:meth:`_settle_mismatches`).
        """
        matchers = [r.matcher for r in reqs]
        pool = self.mask_pool
        if pool is not None and (mirrors or
                                 sum(m is not None for m in matchers) >= pool.num_workers):
            extra = [r for r in mirror_extra if r.matcher is not None]
            try:
                mask = build_grammar_vocab_mask_pooled(
                    pool, self._pool_requests(reqs), matchers, gtree, device=self.runner.device,
                    barrier=barrier, out=out,
                    advance_only=[q for q in self._pool_requests(extra) if q is not None],
                    on_verdicts=(lambda res: self._apply_verdicts([*reqs, *extra], res))
                    if mirrors else None)
                if mask is not None and mask.mirror is not None:
                    self.timer.pool(mask.mirror.send_ms, mask.mirror.worker_busy_ms)
                    if mirrors:
                        self._settle_mismatches([*reqs, *extra], mask.mirror.mismatched)
                self.timer.phase("mask")
                return mask
            except MaskPoolError as e:
                # Drop the pool and build in process: the host matchers replay whatever the
                # mirrors had advanced (or apply what they had not; ``_drop_pool`` covers the
                # running requests, ``extra`` left them), then ``barrier`` runs again (the
                # grammar advance and the text work are idempotent).
                self._drop_pool(pool, e)
                for req in extra:
                    advance_grammar(req)

        def barrier_then_catch_up() -> None:
            if barrier is not None:
                barrier()
            # An in-process walk starts from the host matchers: replay any lag behind a mirror
            # (those ids already had the mirror's verdict, so nothing is dropped here).
            for req in reqs:
                advance_grammar(req)

        mask = build_grammar_vocab_mask(matchers, gtree, vocab_size=self.runner.vocab_size,
                                        device=self.runner.device, barrier=barrier_then_catch_up,
                                        out=out)
        self.timer.phase("mask")
        return mask

    def _sampling_batch(self, reqs: Sequence[Req], n: int, device: torch.device) -> SamplingBatch:
        ps = [r.params for r in reqs]
        all_greedy = all(p.is_greedy for p in ps)

        def col(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            if all_greedy:  # never read: sample_rows returns the argmax first
                return torch.empty(0, dtype=dtype)
            return self._to_device(torch.tensor(values, dtype=dtype).repeat_interleave(n))

        return SamplingBatch(
            temperature=col([p.temperature for p in ps], torch.float32),
            top_k=col([p.top_k for p in ps], torch.int64),
            top_p=col([p.top_p for p in ps], torch.float32),
            min_p=col([p.min_p for p in ps], torch.float32),
            generators=[r.generator or self._engine_generator for r in reqs],
            rows_per_request=n,
            all_greedy=all_greedy,
            use_top_k=any(p.top_k > 0 for p in ps),
            use_top_p=any(p.top_p < 1.0 for p in ps),
            use_min_p=any(p.min_p > 0 for p in ps),
            top_k_max=max(p.top_k for p in ps) if all(p.top_k > 0 for p in ps) else 0,
        )

    def _record_logprobs(
        self, reqs: Sequence[Req], logits: torch.Tensor, accept_nodes: torch.Tensor,
        runs: list[list[int]],
    ) -> None:
        """Target log-probabilities of the run's tokens, after the grammar mask, before
        temperature and filtering (what OpenAI's ``logprobs`` reports)."""
        nodes_cpu = accept_nodes.cpu()
        for b, req in enumerate(reqs):
            k = req.params.logprobs
            if k is None:
                continue
            rows = logits[b, nodes_cpu[b, : len(runs[b])]].float().log_softmax(dim=-1).cpu()
            if req.logprobs is None:
                req.logprobs = []
            for row, tok in zip(rows, runs[b], strict=True):
                top = row.topk(k) if k > 0 else None
                # Tokens the grammar forbids (-inf) are never listed, as in the server.
                req.logprobs.append(TokenLogprob(
                    token_id=tok, logprob=float(row[tok]),
                    top_logprobs=[] if top is None else [
                        (t, v) for t, v in zip(top.indices.tolist(), top.values.tolist(),
                                               strict=True) if v != float("-inf")],
                ))


def _trim_logprobs(req: Req) -> None:
    """Drop logprobs recorded for tokens that a stop cut from the run."""
    if req.logprobs is not None and len(req.logprobs) > len(req.output_ids):
        del req.logprobs[len(req.output_ids):]
