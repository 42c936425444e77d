"""Continuous-batching scheduler: queues, admission, prefill, retirement and outputs.

The scheduler package is the only one that knows both :mod:`structspec.grammar` and
:mod:`structspec.speculative` (docs/architecture.md, "Package map"). A scheduling step is a
prefill (:meth:`Scheduler._run_prefill`: whole prompts, or chunks of them between the verify
steps, :mod:`structspec.scheduler.chunked_prefill`) or one speculative verify step, whose
phases live in :mod:`structspec.scheduler.verify_step`; the grammar side is
:class:`~structspec.scheduler.grammar_service.GrammarService`, the selection after a forward
:mod:`structspec.scheduler.select_verify` (whose function the runner's post-forward CUDA graph
records). KV pages grow on demand and requests are preempted and resumed, in priority order,
by :mod:`structspec.scheduler.preemption`.
"""

from __future__ import annotations

import random
import time

import torch

from structspec.config import EngineConfig
from structspec.core import (
    FinishReason,
    RequestError,
    RequestOutput,
    now,
    request_error_code,
)
from structspec.draft_tree.layout import VerifyTree
from structspec.grammar.backend import GrammarBackend
from structspec.grammar.bitmask import bitmask_width
from structspec.grammar.errors import GrammarError
from structspec.grammar.select_backend import SelectingBackend
from structspec.grammar.worker_pool import MaskWorkerPool
from structspec.kvcache.page_table import HostPageTable
from structspec.kvcache.prefix_cache import PrefixCachingAllocator
from structspec.runner.model_runner import ModelRunner
from structspec.scheduler.chunked_prefill import (
    ChunkedPrefill,
    PrefillBudget,
    PrefillChunk,
    feed_prompt_features,
    prefill_forward,
)
from structspec.scheduler.commit import advance_grammar, commit_tokens, process_text
from structspec.scheduler.deferred_work import finish_deferred
from structspec.scheduler.draft_guard import GuardedDrafter
from structspec.scheduler.grammar_service import GrammarService
from structspec.scheduler.logprobs import trim_logprobs
from structspec.scheduler.penalty_slots import PenaltySlots
from structspec.scheduler.preemption import Preemption, release_kv
from structspec.scheduler.prompt_logprobs import record_prompt_logprobs, reuses_prefix_cache
from structspec.scheduler.request import Req, ReqStatus
from structspec.scheduler.select_verify import SelectVerifyPhase, select_verify
from structspec.scheduler.step_stats import StepTimer
from structspec.scheduler.tree_sizing import AdaptiveTreeSizer
from structspec.scheduler.validate import check_schema_output
from structspec.scheduler.verify_step import VerifyStep
from structspec.scheduler.waiting_queue import WaitingQueue
from structspec.speculative.base import Drafter

#: host sleep of a step that only waits for grammar compiles (seconds)
COMPILE_WAIT_S = 0.001


class Scheduler:
    """Owns every live request and decides what runs each step.

    Args:
        config: the resolved engine config.
        runner: target model runner (owns the KV pool). The scheduler installs its
            select/verify function in it (:meth:`ModelRunner.set_select_verify`) and the
            drafter's aux hidden layers.
        grammar: grammar backend for this model's tokenizer (xgrammar, or the per-request
            choice of ``GrammarConfig.backend`` ``llguidance`` / ``auto``).
        drafter: the speculative drafter (``NoDrafter`` for plain decoding).
        mask_pool: worker processes for the tree bitmask
            (``GrammarConfig.mask_build_workers > 0``); None = walk in this process.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        grammar: GrammarBackend | SelectingBackend,
        drafter: Drafter,
        *,
        mask_pool: MaskWorkerPool | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.drafter = drafter
        #: the drafter as the steps call it: its failures cost speculation, never a request
        self.draft = GuardedDrafter(drafter, runner.device, runner.staging)
        self.num_nodes = drafter.num_nodes
        # EAGLE heads read target features: the target forwards must return them.
        runner.aux_hidden_layers = tuple(drafter.aux_hidden_layers)
        runner.set_select_verify(select_verify, bitmask_width=bitmask_width(runner.vocab_size))
        # Only drafters that override the hook get the (per-forward) call.
        self._feeds_hidden = type(drafter).on_target_hidden is not Drafter.on_target_hidden
        # Prefix caching (kvcache/prefix_cache.py). A drafter that reads the target's
        # features (EAGLE) needs them for every prompt position, which a prefill that skips
        # cached tokens does not compute: the runner then keeps them beside the KV, by slot.
        self.allocator = PrefixCachingAllocator(
            runner.kv_pool.num_pages, runner.page_size,
            enabled=config.cache.enable_prefix_caching)
        if config.cache.enable_prefix_caching and self._feeds_hidden:
            runner.keep_prompt_features()
        #: every running request's pages, one row each (a verify step gathers its batch's)
        self.page_table = HostPageTable(config.scheduler.max_batch_size)
        self.requests: dict[str, Req] = {}
        self.grammar_queue: list[Req] = []
        #: ready requests in admission order: priority, then preempted ones, then arrival
        self.waiting = WaitingQueue()
        self._num_added = 0  # arrival numbers (FCFS among equal priorities)
        self.running: list[Req] = []
        #: which prompt tokens each prefill step computes; holds the request part-way
        #: through a chunked prefill (``chunks.prefilling``)
        self.chunks = ChunkedPrefill(config.scheduler)
        self._finished_unreported: list[Req] = []
        self._deferred: list[Req] = []  # committed ids whose grammar/text work is pending
        self._touched: list[Req] = []  # requests whose progress the next output reports
        #: report the progress of running requests in every step's outputs (streaming). False:
        #: only finished requests are reported (offline loops that read final outputs alone
        #: skip a snapshot per running request and step: ids, text and logprobs copied whole)
        self.report_unfinished = True
        #: constrained requests whose grammar compiled, by backend (``/metrics``)
        self.grammar_backend_counts: dict[str, int] = {}
        # draws the sampling seed of each request that brings none (engine seed ``--seed``):
        # every sampled request then draws by (seed, output position), so even an unseeded
        # run repeats for the same requests in the same order, whatever the tree sizes
        self._seed_rng = random.Random(config.seed)
        #: per verify step CPU phase / GPU busy and idle times (see step_stats.py)
        self.timer = StepTimer(runner.device)
        #: grammar compile, barrier and tree bitmask (owns the backend and the worker pool)
        self.grammar = GrammarService(
            grammar, device=runner.device, vocab_size=runner.vocab_size,
            timer=self.timer,
            live_requests=lambda: [*self.running, *self._deferred], pool=mask_pool)
        #: the penalised requests' rows of the device penalty table
        self.penalties = PenaltySlots(vocab_size=runner.vocab_size,
                                      max_requests=config.scheduler.max_batch_size,
                                      device=runner.device, staging=runner.staging)
        self._select = SelectVerifyPhase(runner, self.penalties)
        #: sizes each request's draft tree from its acceptance and the measured verify cost
        #: (``SpecConfig.adaptive``); None without a drafter
        self.sizer: AdaptiveTreeSizer | None = None
        if drafter.num_nodes > 1:
            self.sizer = AdaptiveTreeSizer(config.spec.adaptive, drafter.num_nodes)
        self._verify = VerifyStep(runner, self.draft, self.grammar, self._select, self.timer,
                                  overlap=config.scheduler.overlap,
                                  feeds_hidden=self._feeds_hidden, page_table=self.page_table,
                                  sizer=self.sizer)
        #: KV growth before each verify step, preemption when the pool runs out, resume
        self.preemption = Preemption(
            config, runner, self.allocator, self.page_table, self.draft, self.penalties,
            self.timer, running=self.running, waiting=self.waiting,
            prefilling=self.chunks.prefilling, num_nodes=self.num_nodes,
            feeds_hidden=self._feeds_hidden, settle=self._settle_deferred, retire=self._retire)

    @property
    def mask_pool(self) -> MaskWorkerPool | None:
        """The grammar's tree-bitmask worker pool (None: none, or dropped after a failure)."""
        return self.grammar.pool

    def close(self) -> None:
        """Stop the mask workers and the grammar compile threads (idempotent)."""
        self.grammar.close()

    # ------------------------------------------------------------------ queue management

    @property
    def num_unfinished(self) -> int:
        return (len(self.grammar_queue) + len(self.waiting) + len(self.running)
                + len(self.chunks.prefilling))

    def kv_tokens_needed(self, req: Req) -> int:
        """KV slots allocated when ``req`` is admitted: its prompt and one draft tree (its
        pages then grow with its output, :meth:`Preemption.grow_for_verify`)."""
        return len(req.prompt_ids) + self.num_nodes

    def kv_tokens_to_finish(self, req: Req) -> int:
        """KV slots ``req`` holds at its longest: prompt, every new token and one tree."""
        return len(req.prompt_ids) + req.max_new_tokens + self.num_nodes

    def add(self, req: Req) -> None:
        """Queue a validated request (grammar compile is started here, never awaited).

        Raises:
            ValueError: when the request can never fit in the KV cache.
            RequestError: the first penalised request's penalty table does not fit on the
                device (:meth:`PenaltySlots.reserve`).
        """
        # A request must be able to finish alone in the pool: the others can be preempted
        # to make room for it, but it cannot be split.
        need_pages = self.allocator.pages_for(self.kv_tokens_to_finish(req))
        if need_pages > self.allocator.num_pages - 1:
            raise ValueError(
                f"request needs {self.kv_tokens_to_finish(req)} KV slots (prompt + max_tokens + "
                f"draft tree) but the cache holds {self.allocator.capacity_tokens}; lower "
                "max_tokens or raise the KV capacity"
            )
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        # What can raise runs before the request is registered (a failed add leaves nothing
        # behind, so its id can be used again).
        if req.has_penalties:
            try:
                self.penalties.reserve()
            except MemoryError as e:  # this request fails; the engine goes on
                raise RequestError(str(e)) from e
        req.sampling_seed = (req.params.seed if req.params.seed is not None
                             else self._seed_rng.getrandbits(63))
        if req.params.grammar is not None:
            req.grammar_future = self.grammar.submit(req.params.grammar)
        self.requests[req.request_id] = req
        req.arrival_seq = self._num_added
        self._num_added += 1
        if req.grammar_future is not None:
            req.status = ReqStatus.WAITING_GRAMMAR
            self.grammar_queue.append(req)
        else:
            req.status = ReqStatus.WAITING
            self.waiting.push(req)

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
        self.chunks.discard(req)
        release_kv(req, self.allocator, self.page_table)
        self.draft.release(req.request_id)
        if self.sizer is not None:
            self.sizer.release(req.request_id)
        self.grammar.release(req.request_id)
        self.penalties.release(req)
        req.finish_time = now()
        req.matcher = None
        if req.params.grammar is not None and req.finish_reason is FinishReason.STOP:
            req.schema_valid = check_schema_output(req.params.grammar, req.text)
        self._finished_unreported.append(req)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and report progress: a prefill forward (whole prompts or
        chunks), a verify forward, or, with chunked prefill while requests decode, both (the
        chunks first, the verify forward queued behind them).

        With ``SchedulerConfig.overlap`` the text processing (detokenization, stop strings,
        outputs) and the grammar advance of step k run after step k+1's verify launch, under
        the GPU forward; without it they run before. Outputs are identical either way.

        Returns:
            One output per request that gained tokens or finished since the last step.
        """
        if self._only_compiling():
            # Nothing to run until a grammar compile finishes: yield the core for a moment
            # instead of spinning. A caller looping on step() (generate(), the server's engine
            # loop) otherwise held one of a 2-core CPU's cores the compile worker needed: the
            # first JSON Schema request's compile took 10.6 s spinning, 4.5 s yielding.
            time.sleep(COMPILE_WAIT_S)
        self._poll_grammar()
        self.preemption.make_room_for_priority()
        self.preemption.resume()  # preempted requests at the queue's front rebuild their KV
        live = [r for r in self.running if not r.finished]
        budget = self.chunks.budget()
        continued = self.chunks.continue_prefills(budget)
        chunks = self.chunks.plan(continued, self._admit(budget), budget)
        if chunks:
            self._run_prefill(chunks)
            if not self.chunks.enabled:
                return self._collect_outputs()  # whole prompts: a step of their own
            # Chunked: the running requests' verify step rides in the same step, its forward
            # queued behind the chunk's on the stream (module doc of chunked_prefill), so a
            # stream waits one chunk's device time, not a whole extra step, per token. The
            # chunk's step ran the previous verify step's deferred work; some may have ended.
            live = [r for r in live if not r.finished]
        if live := self.preemption.grow_for_verify(live):
            self._run_verify(live)
        elif not chunks:
            self._finish_deferred()
        return self._collect_outputs()

    def _collect_outputs(self) -> list[RequestOutput]:
        t = now()
        outputs = []
        deferred = set(map(id, self._deferred))
        report = self.report_unfinished
        for req in self._touched:
            if req.finished:
                if req.finish_time is not None:
                    continue  # retired already (it is reported below, or was before)
                if id(req) in deferred:
                    continue  # its last run's text/grammar work is still pending
                self._retire(req)
            elif report and req.num_reported_ids < req.num_detokenized:
                outputs.append(req.take_output(t))
        self._touched = []
        for req in self._finished_unreported:
            outputs.append(req.take_output(t))
            self.requests.pop(req.request_id, None)
        self._finished_unreported = []
        return outputs

    def _settle_deferred(self, req: Req) -> None:
        """Run ``req``'s deferred grammar barrier and text work now, if it has any (before it
        is preempted); it is reported with this step's outputs."""
        if not any(r is req for r in self._deferred):
            return
        self._deferred = [r for r in self._deferred if r is not req]
        finish_deferred(self.grammar, self.timer, [req])
        self._touched.append(req)

    def _finish_deferred(self) -> None:
        """Run the grammar advance and text processing a previous step deferred."""
        deferred, self._deferred = self._deferred, []
        finish_deferred(self.grammar, self.timer, deferred)
        self._touched.extend(deferred)

    def _only_compiling(self) -> bool:
        """Whether every unfinished request waits for its grammar and nothing else is due
        (no deferred work, no output to report)."""
        return (bool(self.grammar_queue) and self.num_unfinished == len(self.grammar_queue)
                and not self._deferred and not self._finished_unreported
                and not self._touched)

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
                req.grammar_backend = req.matcher.backend
                self.grammar_backend_counts[req.matcher.backend] = \
                    self.grammar_backend_counts.get(req.matcher.backend, 0) + 1
            except GrammarError as e:
                req.finish(FinishReason.ABORT, error=str(e), error_param=e.param,
                           error_code=request_error_code(e.param, e.code))
                self._retire(req)
                continue
            req.grammar_future = None
            self.grammar.prepare(req)  # its grammar starts for its mask worker, if any
            req.status = ReqStatus.WAITING
            self.waiting.push(req)

    def _admit(self, budget: PrefillBudget | None = None) -> list[Req]:
        """Pick waiting requests for one prefill step, in the queue's order (priority, then
        FCFS; stops at the first that won't fit, or at a preempted request, which resumes
        first: :meth:`Preemption.resume`). Each gets the KV of its prompt and one tree; the
        running requests' next trees (:meth:`Preemption.headroom_pages`) stay free.

        ``budget`` grants each picked request its prompt tokens of this step (whole prompts,
        or a first chunk: scheduler/chunked_prefill.py); its ``grants`` list them in order.
        None: a fresh budget of the step (``self.chunks.budget()``).

        The prefill runs only when it is worth a step of its own (``SchedulerConfig.
        min_prefill_batch``): it admits at least that many requests, or every waiting one, or
        its prompt-token budget is full, or fewer than that many requests are running; else
        the waiting requests stay queued and the running batch takes a verify step.
        """
        cfg = self.config.scheduler
        if not self.waiting:
            return []
        if budget is None:
            budget = self.chunks.budget()
        alloc = self.allocator
        picked: list[tuple[Req, list[int], int]] = []  # (request, cached pages, new pages)
        pinned: set[int] = set()  # evictable cached pages the picked requests will reuse
        pages = 0
        budget_full = False
        slots = cfg.max_batch_size - len(self.running) - len(self.chunks.prefilling)
        headroom = self.preemption.headroom_pages()  # the running requests' next trees
        for req in self.waiting:
            if len(picked) >= slots or req.preempted:  # a preempted one resumes first
                break
            # prompt logprobs need every position computed: no cached prefix for them
            hits = alloc.match(req.prompt_ids) if reuses_prefix_cache(req) else []
            plen = len(req.prompt_ids) - len(hits) * alloc.page_size  # tokens to compute
            take = budget.grant(plen)
            if not take:
                budget_full = True
                break
            need = alloc.pages_for(self.kv_tokens_needed(req)) - len(hits)
            # a reused page that is evictable now stops counting as free once reused
            reused_free = [p for p in hits if alloc.is_evictable(p) and p not in pinned]
            if not alloc.can_allocate(pages + need + len(pinned) + len(reused_free) + headroom):
                break
            pinned.update(reused_free)
            picked.append((req, hits, need))
            budget.take(take)
            pages += need
        min_batch = cfg.min_prefill_batch or 1
        if not picked or not (len(picked) >= min_batch or budget_full
                              or len(picked) == len(self.waiting)
                              or len(self.running) < min_batch
                              or self.preemption.outranks_running(picked[0][0])):
            return []
        # Every reused page takes its reference before any allocation, so that no allocation
        # of this batch evicts a page another request of the batch is about to reuse.
        for _, hits, _ in picked:
            alloc.acquire(hits)
        batch: list[Req] = []
        for req, hits, need in picked:
            self.waiting.popleft()
            req.pages = hits + alloc.allocate(need)
            req.num_cached_tokens = len(hits) * alloc.page_size
            alloc.record_admission(len(req.prompt_ids), req.num_cached_tokens)
            req.page_row = self.page_table.add(req.pages)
            req.status = ReqStatus.RUNNING
            batch.append(req)
        return batch

    # ------------------------------------------------------------------ prefill and verify

    def _run_prefill(self, chunks: list[PrefillChunk]) -> None:
        """Write the chunks' prompt KV; each request whose prompt is now complete commits its
        first token (its grammar advance and text work run at once). The previous verify
        step's deferred work runs under the forward."""
        self.timer.break_chain()
        out = prefill_forward(self.runner, chunks, feeds_hidden=self._feeds_hidden)
        self._finish_deferred()
        if out.prompt_logprobs is not None:
            # after the deferred work, which ran under the forward this copy waits for
            record_prompt_logprobs(chunks, out)
        if self._feeds_hidden:
            feed_prompt_features(self.draft, chunks, out)
        for c in chunks:
            # the prompt's full pages written so far are final (later writes start past them)
            c.req.cache_cursor = self.allocator.register(c.req.prompt_ids, c.req.pages,
                                                         c.end, c.req.cache_cursor)
        batch = self.chunks.after_forward(chunks)
        if not batch:
            return
        logits = out.logits
        if len(batch) < len(chunks):
            logits = logits[torch.tensor([i for i, c in enumerate(chunks) if c.last],
                                         device=logits.device)]
        for r in batch:
            if r.has_penalties:
                self.penalties.assign(r)
        tree = VerifyTree.root_only(torch.tensor([r.prompt_ids[-1] for r in batch]))
        gtree = self.grammar.stage_tree(batch, tree)
        selection = self._select.prepare(batch, tree.num_nodes, logits.device, None)
        mask = None if gtree is None else self.grammar.build_mask(
            batch, gtree, plan=None, while_walking=None)
        runs = self._select.launch(batch, tree, logits, None, selection, mask).wait()
        t = now()
        for req, run in zip(batch, runs, strict=True):
            commit_tokens(req, run, t)
            advance_grammar(req)
            process_text(req)
            trim_logprobs(req)
            self.running.append(req)
        self._touched.extend(batch)

    def _run_verify(self, reqs: list[Req]) -> None:
        """One speculative verify step (:class:`VerifyStep`); the previous step's deferred
        work runs under its forward, and this step's is deferred in turn."""
        previous, self._deferred = self._deferred, []
        outcome = self._verify.run(reqs, previous)
        self._touched.extend(outcome.touched)
        self._deferred = outcome.deferred
