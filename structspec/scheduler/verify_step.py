"""One speculative verify step, phase by phase (docs/architecture.md, "The step timeline").

:meth:`VerifyStep.run` reads top to bottom; each phase hands the next a named record:

1. **propose** (:class:`Proposal`): the drafter proposes a :class:`VerifyTree` per request;
2. **stage tree** (:class:`StagedTree`), before the launch: the tree is staged for the host
   (a device tree's D2H copy queued behind the draft kernels) and the grammar service plans
   the barrier (:class:`~structspec.scheduler.grammar_service.GrammarPlan`);
3. **launch verify**: the target verify forward is queued (a drafter that cannot overlap
   gets its mask built first, the GPU idling meanwhile; a host tree whose walks go to the
   mask workers has its build sent first when they would not hide under the forward, and
   the launch runs while they walk: :mod:`~structspec.scheduler.build_order`; a device tree
   likewise, once its copy has landed, in the fixed ``before`` order only);
4. **grammar mask**, under the forward: the previous step's grammar barrier and, where it
   pays, its text work (:class:`~structspec.scheduler.deferred_work.PreviousStepWork`), then
   the tree bitmask, queued to the device;
5. **select/verify** (:class:`~structspec.scheduler.select_verify.Selection`, then a
   :class:`~structspec.scheduler.pending.PendingStep`): mask, targets, tree verification and
   KV compaction, one post-graph replay or eager; the results' D2H copy starts. With the
   mask workers' device gate (:mod:`~structspec.grammar.deferred_build`) this is queued
   before the workers have replied: the bitmask upload waits on the device for their flags;
6. **text**: the previous step's text work left, still under the GPU step; then a deferred
   build's replies are read (timer phase ``mask``);
7. **wait**: the step's one planned host wait (docs/architecture.md, invariant 6);
8. **commit**: accepted runs are committed (:mod:`structspec.scheduler.commit`); this step's
   grammar barrier and text work are deferred to the next step (:class:`StepOutcome`). A
   drafter that reads target features (EAGLE) had them stored between 5 and 6, before the
   wait, and gets the run lengths here.

Timer phases (``draft``, ``launch``, ``barrier``, ``text``, ``mask``, ``wait``, ``commit``)
and events (``fwd_start``, ``fwd_end``, ``post``, ``end``) mark these boundaries
(:mod:`structspec.scheduler.step_stats`; ``/metrics`` reads them by name).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from structspec.core import now
from structspec.draft_tree.layout import VerifyTree
from structspec.grammar.pool_types import PoolRequest
from structspec.grammar.tree_mask import GrammarMaskResult, GrammarTree
from structspec.kvcache.page_table import HostPageTable, PageRows
from structspec.runner.model_runner import ModelRunner, VerifyForwardOutput
from structspec.scheduler.build_order import PoolBuildOrder
from structspec.scheduler.commit import commit_tokens
from structspec.scheduler.deferred_work import PreviousStepWork, finish_deferred
from structspec.scheduler.draft_guard import GuardedDrafter
from structspec.scheduler.grammar_service import GrammarPlan, GrammarService
from structspec.scheduler.logprobs import trim_logprobs
from structspec.scheduler.pending import PendingStep
from structspec.scheduler.request import Req
from structspec.scheduler.select_verify import Selection, SelectVerifyPhase
from structspec.scheduler.step_stats import StepTimer
from structspec.scheduler.tree_fit import fit_trees, real_nodes, tree_to_device
from structspec.scheduler.tree_sizing import AdaptiveTreeSizer, TreePlan, host_tree_nodes
from structspec.speculative.base import DraftRequest, TokenHistory


@dataclass(frozen=True)
class Proposal:
    """Phase 1: the running batch and its drafted trees (``tree``: ``[B, N]``, on the host
    for host drafters, else on the device).

    Attributes:
        plan: the tree sizer's plan (which requests were drafted, the planned ``N``).
        draft_ms: host time of the propose (ms).
    """

    reqs: list[Req]
    draft_reqs: list[DraftRequest]
    tree: VerifyTree
    plan: TreePlan
    draft_ms: float = 0.0


@dataclass(frozen=True)
class StagedTree:
    """Phase 2, before the launch: the host's view of the tree and the grammar plan.

    Attributes:
        grammar_tree: the staged tree, or None when no request of the batch is constrained.
        plan: who serves this step's grammar barrier.
        mask_before_launch: the drafter cannot overlap the mask build with the forward: the
            barrier and the mask build finish before the launch.
    """

    grammar_tree: GrammarTree | None
    plan: GrammarPlan
    mask_before_launch: bool


@dataclass(frozen=True)
class StepOutcome:
    """What a verify step leaves the scheduler.

    Attributes:
        touched: requests whose progress the step's outputs report, in order.
        deferred: requests whose grammar barrier and text work the next step runs.
    """

    touched: list[Req]
    deferred: list[Req]


class VerifyStep:
    """Runs verify steps (see the module doc).

    Args:
        runner: the target runner.
        drafter: the speculative drafter, behind its failure guard (a drafter that raises
            costs speculation, never a request: :mod:`~structspec.scheduler.draft_guard`).
        grammar: the grammar service.
        select: the selection phase (shared with prefill).
        timer: the scheduler's step timer.
        overlap: ``SchedulerConfig.overlap``: defer a step's barrier and text work to the
            next step's forward (else finish them at the end of the step).
        feeds_hidden: the drafter reads target hidden states (``on_target_hidden``).
        page_table: the scheduler's page table (each running request's ``page_row``); None:
            the runner gets the requests' page lists.
        sizer: sizes each request's tree from its acceptance and the measured verify cost
            (:mod:`~structspec.scheduler.tree_sizing`); None: the drafter's full trees.
    """

    def __init__(self, runner: ModelRunner, drafter: GuardedDrafter, grammar: GrammarService,
                 select: SelectVerifyPhase, timer: StepTimer, *, overlap: bool,
                 feeds_hidden: bool, page_table: HostPageTable | None = None,
                 sizer: AdaptiveTreeSizer | None = None) -> None:
        self.sizer = sizer
        self.runner = runner
        self.drafter = drafter
        self.grammar = grammar
        self.select = select
        self.timer = timer
        self.overlap = overlap
        self.feeds_hidden = feeds_hidden
        self.page_table = page_table
        #: whether a host tree's pool build is sent before the verify launch
        #: (:meth:`_launch_under_walks`) or right after it, from the measured walk and
        #: forward times (:mod:`~structspec.scheduler.build_order`)
        self.build_order = PoolBuildOrder(forward_on_host=runner.device.type != "cuda")
        #: a device tree's text work starts while the tree is on its way (mirrors serving
        #: the barrier; :meth:`_grammar_mask`); False waits for the tree first (A/B runs)
        self.text_while_drafting = True

    def run(self, reqs: list[Req], previous: list[Req]) -> StepOutcome:
        """One verify step over ``reqs`` (running, unfinished); ``previous`` are the last
        step's requests, whose deferred work runs under this step's forward."""
        timer = self.timer
        t_start = time.perf_counter()
        timer.begin(len(reqs), self.drafter.num_nodes, sum(r.matcher is not None for r in reqs))
        proposal = self._propose(reqs)  # 1. propose
        drafting = len(proposal.plan.drafted) if proposal.tree.num_nodes > 1 else 0
        timer.note_nodes(proposal.tree.num_nodes, drafting, len(reqs) - drafting)
        timer.event("fwd_start")
        staged = self._stage_tree(proposal, previous)  # 2. stage tree, plan the barrier
        # When the mask workers advance the grammar (either tree kind), the text work runs
        # while they advance and walk, after their predicted verdicts are applied. Otherwise:
        # a device tree reaches the host only when the draft kernels finish and the in-process
        # build blocks on that copy, so the previous step's text work goes first, into that
        # wait; a host tree is there already, so its mask goes first (the forward is waiting).
        text_first = not self.drafter.tree_on_host or staged.plan.barrier_in_workers
        work = PreviousStepWork(staged.plan, self.grammar, timer, text_first=text_first,
                                mask_build=staged.grammar_tree is not None)
        early_mask = self._mask_before_launch(proposal, staged, work)
        pool_walks = self._walks_before_launch(proposal, staged)
        mask: GrammarMaskResult | None = None
        try:
            if pool_walks is not None:
                # 3 and 4 together: the workers walk while this thread launches the verify
                fwd, selection, mask = self._launch_under_walks(proposal, staged, work,
                                                                pool_walks)
            else:
                fwd = self._launch_verify(proposal)  # 3. launch verify
                # From here the GPU runs the verify forward; the host work below hides under
                # it.
                selection = self.select.prepare(reqs, proposal.tree.num_nodes,
                                                fwd.logits.device, fwd)
                mask = early_mask if staged.mask_before_launch else self._grammar_mask(
                    proposal, staged, work, selection.graph_bitmask)  # 4. barrier + mask
            timer.pool_order(pool_walks is not None)  # kept only if the pool built the mask
            if mask is not None:
                # before the "post" event, so a bitmask upload still running on the copy
                # stream when the forward ends counts as the grammar stall (fwd_end -> post)
                mask.wait_upload()
            timer.event("post")
            pending = self.select.launch(reqs, proposal.tree, fwd.logits, fwd, selection,
                                         mask)  # 5. select/verify, D2H copy queued
            timer.event("end")
            timer.phase("launch")
            if self.feeds_hidden:
                # The drafter's feature store, queued behind the post graph before the wait:
                # its launches (~0.6 ms of host at batch 1 on the H200 host) then run while
                # the GPU verifies instead of while it idles; the run lengths follow in
                # _commit.
                self.drafter.on_target_hidden(proposal.draft_reqs, fwd.hidden_states,
                                              pending.result.accept_nodes, None,
                                              fwd.aux_hidden_states)
                timer.phase("commit")
            touched = work.finish_text()  # 6. the previous step's text work left
            timer.phase("text")
        finally:
            if mask is not None and mask.pending is not None:
                # a deferred build (the upload waits on the device for the workers' flags):
                # its replies are read now, behind the post graph, and always before the
                # commit (and before an error leaves the step); a capture on the way (a host
                # sync) read them already (staging.register_before_host_sync)
                mask.complete()
                timer.pool_order(pool_walks is not None)  # the pool's timings came with them
                timer.phase("mask")
        runs = pending.wait()  # 7. the one planned host wait of the step
        timer.phase("wait")
        self._commit(proposal, pending, runs)  # 8. commit
        timer.phase("commit")
        if self.sizer is not None:
            plan = proposal.plan
            self.sizer.observe_step(len(reqs) * proposal.tree.num_nodes,
                                    (time.perf_counter() - t_start) * 1e3, proposal.draft_ms,
                                    len(plan.drafted) if plan.num_nodes > 1 else 0,
                                    draft_nodes=plan.num_nodes)
        outcome = StepOutcome(touched, reqs)
        if not self.overlap:
            finish_deferred(self.grammar, timer, reqs)
            outcome = StepOutcome([*touched, *reqs], [])
        for req in reqs:
            trim_logprobs(req)
        timer.end()
        self.build_order.observe(timer.latest())
        return outcome

    # ------------------------------------------------------------------ phases

    def _propose(self, reqs: list[Req]) -> Proposal:
        """Phase 1 (timer phase ``draft``): the sizer plans each request's tree size, the
        drafter proposes for the requests it drafts, and the trees are laid out at the plan's
        size (:func:`~structspec.scheduler.tree_fit.fit_trees`; a host tree also drops the
        padding columns no row uses)."""
        draft_reqs = [DraftRequest(r.request_id, TokenHistory(r.prompt_ids, r.output_ids),
                                   r.seq_len) for r in reqs]
        t0 = time.perf_counter()
        if self.sizer is None:
            plan = TreePlan(self.drafter.num_nodes, tuple(range(len(reqs))), full=True)
        else:
            plan = self.sizer.plan([r.request_id for r in reqs])
        if plan.full:
            tree = self.drafter.propose(draft_reqs)
        else:
            sub = None
            if plan.num_nodes > 1 and plan.drafted:
                # trees of plan.num_nodes nodes: a model drafter runs only the expansion
                # depths such a tree can use (a 2-node probe is its catch-up alone)
                sub = self.drafter.propose([draft_reqs[i] for i in plan.drafted],
                                           max_nodes=plan.num_nodes)
            n = plan.num_nodes
            if sub is not None and sub.device.type == "cpu" and self.sizer is not None:
                n = min(n, host_tree_nodes(real_nodes(sub), self.sizer.sizes))
            # a host drafter's tree is fitted on the host (the runner stages it whole at the
            # launch): its padding must not go through the device staging ring
            staging = None if self.drafter.tree_on_host else self.runner.staging
            tree = fit_trees([d.token_ids[-1] for d in draft_reqs], plan.drafted, sub, n,
                             staging)
            if not self.drafter.tree_on_host and tree.device != self.runner.device:
                # nothing drafted: a device drafter's step still verifies a device tree
                tree = tree_to_device(tree, self.runner.device, staging)
        draft_ms = (time.perf_counter() - t0) * 1e3
        self.timer.phase("draft")
        return Proposal(reqs, draft_reqs, tree, plan, draft_ms)

    def _stage_tree(self, proposal: Proposal, previous: list[Req]) -> StagedTree:
        """Phase 2: stage the tree for the mask build before the launch; plan the barrier."""
        gtree = self.grammar.stage_tree(proposal.reqs, proposal.tree)
        plan = self.grammar.plan_step(proposal.reqs, previous)
        before = gtree is not None and not self.drafter.supports_grammar_overlap
        return StagedTree(gtree, plan, mask_before_launch=before)

    def _mask_before_launch(self, proposal: Proposal, staged: StagedTree,
                            work: PreviousStepWork) -> GrammarMaskResult | None:
        """Synchronous fallback for drafters that cannot overlap: the barrier and the mask
        build finish before the verify launch (the GPU idles meanwhile)."""
        if not staged.mask_before_launch:
            return None
        assert staged.grammar_tree is not None
        return self.grammar.build_mask(proposal.reqs, staged.grammar_tree, plan=staged.plan,
                                       while_walking=work.barrier_and_text)

    def _launch_verify(self, proposal: Proposal) -> VerifyForwardOutput:
        """Phase 3 (timer event ``fwd_end``, phase ``launch``). A host tree goes to the runner
        as is: a graph replay stages it into the graph's static inputs with one pinned copy;
        only the eager path needs a device copy."""
        reqs = proposal.reqs
        rows = [r.page_row for r in reqs]
        pages: PageRows | list[list[int]]
        if self.page_table is not None and None not in rows:
            pages = self.page_table.rows(rows)  # type: ignore[arg-type]
        else:
            pages = [r.pages for r in reqs]
        fwd = self.runner.verify(proposal.tree, [r.seq_len for r in reqs], pages)
        self.timer.event("fwd_end")
        self.timer.phase("launch")
        return fwd

    def _walks_before_launch(self, proposal: Proposal,
                             staged: StagedTree) -> list[PoolRequest | None] | None:
        """What the mask workers walk (:meth:`GrammarService.pool_walks`) when this step's
        build goes out before the verify launch, as the build order (:attr:`build_order`)
        decides; None when the launch goes first.

        The launch reads nothing the build changes. A host tree (n-gram) is on the host
        already. A device tree (EAGLE, draft model) goes first only when the mirrors serve the
        barrier: the build then waits for the drafted tree's copy (the draft kernels), sends,
        and the launch runs while the workers walk; with the host matchers' barrier the
        launch would run before the tree's copy is waited for anyway."""
        tree = staged.grammar_tree
        if tree is None or staged.mask_before_launch:
            return None
        device_tree = not self.drafter.tree_on_host
        if device_tree and not staged.plan.barrier_in_workers:
            return None
        if not self.build_order.send_first(device_tree=device_tree):
            return None
        return self.grammar.pool_walks(proposal.reqs, staged.plan)

    def _launch_under_walks(self, proposal: Proposal, staged: StagedTree,
                            work: PreviousStepWork, pool_walks: list[PoolRequest | None],
                            ) -> tuple[VerifyForwardOutput, Selection, GrammarMaskResult | None]:
        """Phases 3 and 4 for :meth:`_walks_before_launch`: the workers get their walks first
        (a device tree's once its copy has landed), and the verify launch (a graph replay's
        staging, ~0.5-1 ms of host time at batch 32-64 on the H200 host) runs while they
        walk, then the barrier and text work: the order :attr:`build_order` picks when the
        walks would outlast the forward launched first. The mask is uploaded into a buffer of its own (the post graph's static bitmask
        is known only after the launch) and copied into the graph's on the device.

        The launch is attempted once: a pool that fails mid-build retries in process and
        calls ``while_walking`` again, which then runs only the (idempotent) barrier and text
        work; a launch that raised (its error possibly replaced by a worker's failure read
        in the pool's cleanup) is raised again after the build, never retried.
        """
        reqs = proposal.reqs
        attempted: list[bool] = []
        launched: list[tuple[VerifyForwardOutput, Selection]] = []
        failed: list[BaseException] = []

        def launch_then_barrier() -> None:
            if not attempted:
                attempted.append(True)
                try:
                    fwd = self._launch_verify(proposal)
                    launched.append((fwd, self.select.prepare(
                        reqs, proposal.tree.num_nodes, fwd.logits.device, fwd)))
                except BaseException as e:
                    failed.append(e)
                    raise
            work.barrier_and_text()

        assert staged.grammar_tree is not None
        mask = self.grammar.build_mask(reqs, staged.grammar_tree, plan=staged.plan,
                                       while_walking=launch_then_barrier,
                                       pool_requests=pool_walks, defer=True)
        if failed:
            if mask is not None:
                mask.complete()  # a deferred build's replies: read before the error leaves
            raise failed[0]
        if not attempted:  # every path of build_mask runs while_walking; kept for safety
            launch_then_barrier()
        fwd, selection = launched[0]
        return fwd, selection, mask

    def _grammar_mask(self, proposal: Proposal, staged: StagedTree, work: PreviousStepWork,
                      graph_bitmask: torch.Tensor | None) -> GrammarMaskResult | None:
        """Phase 4, under the forward: the barrier (and text work), then the tree bitmask,
        uploaded into the post graph's static bitmask when there is one. Without a
        constrained request in the batch only the barrier runs."""
        if staged.grammar_tree is None:
            work.barrier_and_text()
            return None
        # a device tree's text work starts while the tree is on its way (with the mirrors'
        # barrier; the build applies their predicted verdicts first) instead of after the
        # host's wait for the draft kernels (H200, EAGLE + JSON at batch 8-64: the phase
        # holding that wait and the send took 0.2-0.5 ms; the step ratio moved 1.15 -> 1.09 on
        # average over 8 A/B pairs, inside the repeats' spread: benchmarks/README.md,
        # "Fourteenth H200 run")
        return self.grammar.build_mask(proposal.reqs, staged.grammar_tree, plan=staged.plan,
                                       while_walking=work.barrier_and_text,
                                       out=graph_bitmask,
                                       while_drafting=work.barrier_and_text
                                       if self.text_while_drafting else None, defer=True)

    def _commit(self, proposal: Proposal, pending: PendingStep, runs: list[list[int]]) -> None:
        """Phase 8: commit each accepted run (stops trim it), count the speculation metrics,
        tell the drafter."""
        reqs, draft_reqs = proposal.reqs, proposal.draft_reqs
        for req, run in zip(reqs, runs, strict=True):
            if not run and not req.finished:  # non-finite logits: it ends below, unhooked
                self.drafter.stop(req.request_id)
        if self.feeds_hidden:
            # Features of node 0 and the accepted drafts count (the bonus has no KV yet);
            # they were stored before the wait (run)
            self.drafter.commit_target_hidden(draft_reqs, [len(r) for r in runs])
        t = now()
        committed: list[list[int]] = []
        ended: list[Req] = []
        nodes = proposal.tree.num_nodes
        drafted = set(proposal.plan.drafted) if not proposal.plan.full else None
        probes = set(proposal.plan.probes)
        sizer = self.sizer
        for b, (req, run, proposed) in enumerate(
                zip(reqs, runs, pending.num_real_drafts, strict=True)):
            if req.finished or not run:  # ended by a stop string found after this step was
                # launched; or no run: non-finite logits, and commit_tokens ends it
                commit_tokens(req, run, t)
                committed.append([])
                ended.append(req)
                continue
            spec = req.spec
            spec.verify_steps += 1
            spec.draft_tokens_proposed += proposed
            spec.draft_tokens_accepted += len(run) - 1
            size = nodes if drafted is None or b in drafted else 1
            spec.tree_sizes[size] = spec.tree_sizes.get(size, 0) + 1
            if size == 1 and self.drafter.num_nodes > 1:
                spec.steps_without_draft += 1
            if sizer is not None:
                sizer.observe_request(req.request_id, proposed, len(run) - 1,
                                      probe=b in probes)
            kept = commit_tokens(req, run, t)
            spec.committed_tokens += len(kept)
            req.seq_len += len(run)
            committed.append(kept)
            if req.finished:
                ended.append(req)
        self.drafter.on_verified(draft_reqs, committed)
        for req in ended:
            self.drafter.release(req.request_id)
            if sizer is not None:
                sizer.release(req.request_id)
