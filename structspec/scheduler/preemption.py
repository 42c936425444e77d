"""KV allocation on demand, preemption by recompute, and priority preemption.

A request is admitted with the KV pages of its prompt plus one draft tree
(``Scheduler.kv_tokens_needed``); its pages grow as its output grows:
:meth:`Preemption.grow_for_verify` gives every running request, before each verify step, the
pages of the rows its tree writes (positions ``seq_len .. seq_len + num_nodes - 1``, see
``runner/batch_builder.py``). When the pool cannot give them, the running request with the
lowest priority, the newest among equals (:func:`~structspec.scheduler.waiting_queue.
victim_key`), is **preempted** (vLLM V1's recompute preemption):

* its pages are freed (its full prompt pages stay in the prefix cache, evictable, so the
  resume finds them when nothing evicted them meanwhile), its drafter state is dropped (draft
  model KV, EAGLE features, n-gram index; rebuilt from the history on resume) and its
  penalty slot is freed (refilled with its committed output's counts on resume);
* everything that describes its output is kept: the committed ids, the detokenizer and text
  (stop strings), the repetition stop, the logprobs, and the grammar matcher, brought to the
  committed state first (the request's deferred barrier and text work run at preemption, and
  a host matcher that lags its mask-worker mirror catches up), so no id is ever advanced
  twice (docs/architecture.md, invariant 3) nor emitted twice;
* it goes back to the front of the waiting queue (of its priority). :meth:`Preemption.resume`
  re-prefills ``prompt + output[:-1]`` (the last output id is node 0 of the next tree, as it
  always is) and puts it back in the running batch; no token is committed by that prefill,
  so outputs, streaming offsets and the grammar state go on exactly where they stopped.

With priorities, :meth:`Preemption.make_room_for_priority` also preempts running requests
of a strictly lower priority when the request at the head of the waiting queue has no batch
slot or no KV (vLLM's priority scheduling): a short high-priority request does not wait for
long low-priority ones to finish.

Progress is guaranteed: ``Scheduler.add`` refuses a request that could not finish alone in
the pool (prompt + ``max_tokens`` + one tree), and a request that runs alone can always grow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from structspec.config import EngineConfig
from structspec.kvcache.page_table import HostPageTable
from structspec.kvcache.prefix_cache import PrefixCachingAllocator
from structspec.runner.model_runner import ModelRunner
from structspec.scheduler.chunked_prefill import FeatureSpan, feed_target_features
from structspec.scheduler.commit import advance_grammar
from structspec.scheduler.draft_guard import GuardedDrafter
from structspec.scheduler.penalty_slots import PenaltySlots
from structspec.scheduler.request import Req, ReqStatus
from structspec.scheduler.step_stats import StepTimer
from structspec.scheduler.waiting_queue import WaitingQueue, victim_key


def release_kv(req: Req, allocator: PrefixCachingAllocator, page_table: HostPageTable) -> None:
    """Free ``req``'s KV pages (prefix-cached ones stay cached, evictable once unreferenced)
    and its page-table row (retirement and preemption)."""
    if req.pages:
        allocator.free(req.pages)
        req.pages = []
    req.cache_cursor = None
    if req.page_row is not None:
        page_table.remove(req.page_row)
        req.page_row = None


@dataclass
class PreemptionStats:
    """Counters since the engine started (host ints).

    Attributes:
        preemptions: running requests preempted (their KV freed, to be recomputed).
        resumed: preempted requests whose KV was rebuilt and that run again.
        recomputed_tokens: prompt + output tokens those resumes prefilled again (cache hits
            excluded).
    """

    preemptions: int = 0
    resumed: int = 0
    recomputed_tokens: int = 0


class Preemption:
    """The scheduler's KV growth, preemption and resume (see the module doc).

    Works on the scheduler's own objects (the same ``running`` list and ``waiting`` queue).

    Args:
        config: the engine config (``max_batch_size``, ``max_prefill_tokens``).
        runner: the target runner (the resume prefill).
        allocator: the KV page allocator with the prefix cache.
        page_table: the running requests' page rows.
        draft: the guarded drafter (state dropped at preemption, features fed on resume).
        penalties: the penalty slots (freed at preemption, refilled on resume).
        timer: the step timer (a resume prefill breaks the verify chain).
        running: the scheduler's running list.
        waiting: the scheduler's waiting queue.
        prefilling: the requests part-way through a chunked prefill (they hold batch slots
            and the KV of their prompt and one tree; never preempted).
        num_nodes: nodes of the largest draft tree (1 without a drafter).
        feeds_hidden: the drafter reads target features (EAGLE): the resume hands it every
            position's.
        settle: runs a request's deferred grammar barrier and text work now (and reports
            it), if it has any.
        retire: retires a finished request (frees what it holds, reports it).
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner,
                 allocator: PrefixCachingAllocator, page_table: HostPageTable,
                 draft: GuardedDrafter, penalties: PenaltySlots, timer: StepTimer, *,
                 running: list[Req], waiting: WaitingQueue, prefilling: list[Req],
                 num_nodes: int,
                 feeds_hidden: bool, settle: Callable[[Req], None],
                 retire: Callable[[Req], None]) -> None:
        self.config = config
        self.runner = runner
        self.allocator = allocator
        self.page_table = page_table
        self.draft = draft
        self.penalties = penalties
        self.timer = timer
        self.running = running
        self.waiting = waiting
        self.prefilling = prefilling
        self.num_nodes = num_nodes
        self.feeds_hidden = feeds_hidden
        self._settle = settle
        self._retire = retire
        self.stats = PreemptionStats()

    # ------------------------------------------------------------------ page accounting

    def headroom_pages(self) -> int:
        """Pages the running requests need, beyond those they hold, for their next two
        verify steps' trees (positions up to ``seq_len + 2 * num_nodes``).

        Admission and resume leave these free, so a request just admitted is not the
        victim of the very next step's growth (a prefill thrown away at once).
        """
        alloc, lookahead = self.allocator, 2 * self.num_nodes
        return sum(max(0, alloc.pages_for(r.seq_len + lookahead) - len(r.pages))
                   for r in self.running if not r.finished)

    def _resume_ids(self, req: Req) -> list[int]:
        """The tokens whose KV a preempted request's resume rebuilds: prompt + output[:-1]."""
        return req.prompt_ids + req.output_ids[:-1]

    def _admission_pages(self, req: Req) -> int:
        """Pages the admission (or resume) of waiting ``req`` allocates, cache hits aside."""
        held = len(req.prompt_ids) + (len(req.output_ids) - 1 if req.preempted else 0)
        return self.allocator.pages_for(held + self.num_nodes)

    # ------------------------------------------------------------------ before a verify step

    def grow_for_verify(self, live: Sequence[Req]) -> list[Req]:
        """Give each request of ``live`` (running, unfinished) the pages its next tree writes,
        preempting the lowest-priority, newest running requests while the pool is short.

        Requests are served best first (priority, then arrival), so the victims are taken
        from the end of that order; a request may be its own victim.

        Returns:
            ``live`` without the preempted requests, in its order.
        """
        alloc, table = self.allocator, self.page_table
        for req in sorted(live, key=victim_key):
            if req.preempted or req.finished:
                continue
            short = alloc.pages_for(req.seq_len + self.num_nodes) - len(req.pages)
            if short <= 0:
                continue
            while not (alloc.can_allocate(short) or req.preempted or req.finished):
                victims = [r for r in self.running if not r.finished]
                self.preempt(max(victims, key=victim_key))
            if req.preempted or req.finished:
                continue
            new = alloc.allocate(short)
            req.pages.extend(new)
            assert req.page_row is not None
            table.extend(req.page_row, new)
        return [r for r in live if not r.preempted and not r.finished]

    def make_room_for_priority(self) -> None:
        """Preempt running requests of a strictly lower priority than the head of the waiting
        queue while the head has no batch slot or no KV (newest first among equals)."""
        if not self.waiting:
            return
        head = self.waiting[0]
        max_batch = self.config.scheduler.max_batch_size
        while True:
            lower = [r for r in self.running if not r.finished and r.priority > head.priority]
            if not lower:
                return
            no_slot = len(self.running) + len(self.prefilling) >= max_batch
            need = self._admission_pages(head) + self.headroom_pages()
            if not no_slot and self.allocator.can_allocate(need):
                return
            self.preempt(max(lower, key=victim_key))

    def outranks_running(self, req: Req) -> bool:
        """Whether waiting ``req`` has a strictly higher priority than a running request: its
        prefill then runs at once (no wait for a fuller prefill batch)."""
        return any(r.priority > req.priority for r in self.running if not r.finished)

    # ------------------------------------------------------------------ preempt and resume

    def preempt(self, req: Req) -> None:
        """Free a running request's KV and put it back at the front of the waiting queue
        (of its priority), keeping its output, grammar, penalty and stop state.

        A request that its deferred text work or grammar barrier finishes (a stop string,
        the grammar's end) is retired instead.
        """
        self._settle(req)  # its last step's barrier and text work, now
        advance_grammar(req)  # a host matcher lagging its worker mirror catches up
        if req.finished:
            self._retire(req)
            return
        self.running.remove(req)
        release_kv(req, self.allocator, self.page_table)
        self.draft.reset(req.request_id)
        self.penalties.release(req)
        req.seq_len = 0
        req.preempted = True
        req.num_preemptions += 1
        req.status = ReqStatus.WAITING
        self.waiting.push(req)
        self.stats.preemptions += 1

    def resume(self) -> int:
        """Rebuild the KV of the preempted requests at the front of the waiting queue (as
        many as fit, in order) with one prefill; they run again from the next verify step.

        Returns:
            How many requests resumed.
        """
        picked = self._pick_resumed()
        if not picked:
            return 0
        self.timer.break_chain()
        batch = [r for r, _ in picked]
        cached = [c for _, c in picked]
        ids = [self._resume_ids(r) for r in batch]
        for r in batch:
            if r.has_penalties:
                self.penalties.assign(r)
        out = self.runner.prefill(ids, [r.pages for r in batch],
                                  cached if any(cached) else None,
                                  logits_only=not self.feeds_hidden)
        if self.feeds_hidden:  # every position's features, as a fresh prefill
            feed_target_features(self.draft, [
                FeatureSpan(r.request_id, i, 0, len(i), c)
                for r, i, c in zip(batch, ids, cached, strict=True)], out)
        for r, i, c in zip(batch, ids, cached, strict=True):
            r.seq_len = len(i)
            # only prompt pages are ever cached (drafted KV never lands in a cached page)
            r.cache_cursor = self.allocator.register(r.prompt_ids, r.pages, len(r.prompt_ids))
            r.preempted = False
            r.status = ReqStatus.RUNNING
            self.running.append(r)
            self.stats.resumed += 1
            self.stats.recomputed_tokens += len(i) - c
        return len(batch)

    def _pick_resumed(self) -> list[tuple[Req, int]]:
        """Take the preempted requests at the front of the waiting queue that fit (batch
        slots, the prefill token budget, KV with the running requests' headroom), allocate
        their pages (cached prompt pages reused) and give them page rows.

        Returns:
            ``(request, leading tokens whose KV came from the prefix cache)`` per request.
        """
        cfg = self.config.scheduler
        alloc = self.allocator
        picked: list[tuple[Req, int]] = []
        tokens = 0
        while self.waiting and self.waiting[0].preempted:
            req = self.waiting[0]
            if len(self.running) + len(self.prefilling) + len(picked) >= cfg.max_batch_size:
                break
            ids = self._resume_ids(req)
            hits = alloc.match(ids)
            plen = len(ids) - len(hits) * alloc.page_size
            if picked and tokens + plen > cfg.max_prefill_tokens:
                break
            need = alloc.pages_for(len(ids) + self.num_nodes) - len(hits)
            # reused evictable pages stop counting as free once acquired
            reused_free = sum(alloc.is_evictable(p) for p in hits)
            if not alloc.can_allocate(need + reused_free + self.headroom_pages()):
                break
            self.waiting.popleft()
            alloc.acquire(hits)
            req.pages = hits + alloc.allocate(need)
            req.page_row = self.page_table.add(req.pages)
            picked.append((req, len(hits) * alloc.page_size))
            tokens += plen
        return picked
