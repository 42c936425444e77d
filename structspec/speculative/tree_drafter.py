"""The tree-drafter base: what the draft-model and EAGLE drafters share.

:class:`TreeDrafter` owns the draft KV pages of every request (:class:`DraftReqState`), plans
each propose on the host (which requests are drafted, their catch-up ranges), runs the catch-up
forward(s) and the EAGLE-2 expansion (:func:`~structspec.speculative.expansion.expand_tree`)
over the subclass's draft network, and returns the tree on the device. The draft KV layout and
the forward batches are described in :mod:`structspec.speculative.draft_batches`.

On CUDA the catch-up and the whole expansion of a propose are one CUDA-graph replay per
(batch, page-table width) bucket; see :mod:`structspec.speculative.draft_graph`. The eager
path stages its small host tensors through the drafter's own pinned
:class:`~structspec.staging.Staging` (non-blocking H2D copies, no host sync;
docs/architecture.md, invariant 6).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.kvcache.allocator import PageAllocator
from structspec.kvcache.page_table import HostPageTable, PageRows
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.runner.cuda_graph import DEFAULT_BATCH_SIZES
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.draft_batches import (
    FrontierLayout,
    build_extend_batch,
    build_frontier_batch,
    frontier_layout,
)
from structspec.speculative.draft_graph import (
    DraftGraph,
    DraftGraphCache,
    ProposePlan,
    draft_page_buckets,
)
from structspec.speculative.expansion import ExpandedTree, expand_tree
from structspec.staging import Staging, to_device


def default_draft_pages(spec: SpecConfig, target: Any, max_batch_size: int) -> int:
    """Draft KV pages: the target's page count plus, per request, scratch pages for the
    deepest expansion (``(depth - 1) * topk + 1`` frontier slots) and one spare.

    Args:
        spec: ``depth`` and ``topk``.
        target: the target ModelRunner (its ``page_size`` and ``kv_pool.num_pages``).
        max_batch_size: requests that may hold scratch pages at once.
    """
    page_size = int(target.page_size)
    scratch_pages = -(-((spec.depth - 1) * spec.topk + 1) // page_size) + 1
    return int(target.kv_pool.num_pages) + max_batch_size * scratch_pages


def target_graph_max_len(target: Any) -> int | None:
    """The longest sequence the target runner's verify graphs cover (its largest KV bucket,
    tokens), or None when it has no graphs."""
    graphs = getattr(target, "graphs", None)
    return None if graphs is None else max(graphs.page_buckets) * int(target.page_size)


def target_graph_options(
    target: Any, use_cuda_graph: bool, batch_sizes: Sequence[int] | None
) -> dict[str, Any]:
    """:class:`TreeDrafter` graph options that follow the target runner: graphs only when the
    target replays its verify from graphs too (``EngineConfig.cuda_graph``), its batch buckets
    (unless ``batch_sizes`` is given) and its longest KV bucket."""
    graphs = getattr(target, "graphs", None)
    opts: dict[str, Any] = {
        "use_cuda_graph": use_cuda_graph and bool(getattr(target, "use_cuda_graph", True)),
        "cuda_graph_batch_sizes": batch_sizes,
    }
    if graphs is not None:
        if batch_sizes is None:
            opts["cuda_graph_batch_sizes"] = tuple(graphs.batch_sizes)
        opts["cuda_graph_max_model_len"] = target_graph_max_len(target)
    return opts


@dataclass
class DraftReqState:
    """Host bookkeeping of one request in a model-based drafter.

    Attributes:
        pages: the request's pages in the drafter's KV pool.
        kv_len: committed entries with valid draft KV (positions ``0..kv_len-1``).
        feat_len: positions with a stored target feature (EAGLE only).
        row: its row of :attr:`TreeDrafter.page_table`, which mirrors ``pages``.
    """

    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    feat_len: int = 0
    row: int = -1  # the request's row of the drafter's HostPageTable (its ``pages``)


class TreeDrafter(Drafter):
    """Base of the draft-model and EAGLE drafters: draft KV pages, catch-up, EAGLE-2 expansion.

    Subclasses define what a committed *entry* is (:meth:`num_entries`, :meth:`entry_tokens`)
    and run the draft network (:meth:`extend_forward`, :meth:`step_forward`). The tree is built
    and returned on the device (``tree_on_host = False``) without host syncs; the only host
    work is per-request bookkeeping and the catch-up batch layout.

    On CUDA (with ``use_cuda_graph``) a propose is one CUDA-graph replay of the catch-up and the
    whole expansion (:mod:`structspec.speculative.draft_graph`), its inputs staged with one pinned
    buffer and one non-blocking copy; batches or page tables above the largest bucket run the
    eager path (one H2D per catch-up tensor, then the expansion's kernels one by one). A tree
    returned from a graph is a view of static buffers: valid until the next :meth:`propose`.

    Args:
        spec: ``num_draft_tokens`` (N, node 0 included), ``depth``, ``topk``.
        kv_pool: the drafter's KV pool (its own, never the target's).
        device: where the draft network and its pool live.
        use_cuda_graph: replay proposes from CUDA graphs (ignored off CUDA).
        cuda_graph_batch_sizes: batch-size buckets (default: the target's, else
            :data:`~structspec.runner.cuda_graph.DEFAULT_BATCH_SIZES`).
        cuda_graph_max_model_len: longest sequence a graph covers (default: the target graphs'
            largest KV bucket, else 8192); longer ones run eagerly.

    Raises:
        ValueError: ``topk`` or ``depth`` below 1.
    """

    tree_on_host = False
    supports_grammar_overlap = True
    #: keep each graph's ``root_logp [B, V']`` as a static output, so :attr:`last_root_logp`
    #: is set after graph proposes (tests/debugging; costs ``B * V' * 4`` bytes per graph).
    graph_keeps_root_logp: bool = False

    def __init__(
        self, spec: SpecConfig, kv_pool: KVPool, *, device: torch.device,
        use_cuda_graph: bool = True, cuda_graph_batch_sizes: Sequence[int] | None = None,
        cuda_graph_max_model_len: int | None = None,
    ) -> None:
        super().__init__(spec.num_draft_tokens)
        if spec.topk < 1 or spec.depth < 1:
            raise ValueError(f"topk ({spec.topk}) and depth ({spec.depth}) must be >= 1")
        self.topk = spec.topk
        self.depth = spec.depth
        self.device = torch.device(device)
        #: pinned H2D staging of the eager path's host tensors (CUDA), None on CPU.
        self.staging: Staging | None = (
            Staging(self.device) if self.device.type == "cuda" else None)
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.allocator = PageAllocator(kv_pool.num_pages, kv_pool.page_size)
        self.scratch = (self.depth - 1) * self.topk
        self.states: dict[str, DraftReqState] = {}
        #: every request's draft pages, one row each, for the batch page tables of a propose
        #: and of :meth:`on_target_hidden` (one numpy gather instead of one conversion per
        #: request and step: :mod:`structspec.kvcache.page_table`)
        self.page_table = HostPageTable()
        #: ``[B, V']`` float32 log-probs of the root's children from the last propose, row b =
        #: request b (tests and debugging; rows of requests that were not drafted are
        #: undefined; None after a graph propose unless :attr:`graph_keeps_root_logp`).
        self.last_root_logp: torch.Tensor | None = None
        #: ``max(catch-up length)`` up to which requests share one catch-up forward; longer
        #: ones (first sight of a prompt) run in a second forward so short rows are not padded.
        #: Also the graphs' catch-up width ``Q``: the longest accepted run (``depth`` drafts,
        #: then the bonus token) plus one, so steady decoding stays in the graph.
        self.short_catch_up = self.depth + 2
        #: the propose graphs; None = always eager (CPU, or graphs off).
        self.graphs: DraftGraphCache | None = None
        if use_cuda_graph and self.device.type == "cuda":
            self.graphs = DraftGraphCache(
                batch_sizes=cuda_graph_batch_sizes or DEFAULT_BATCH_SIZES,
                page_buckets=draft_page_buckets(cuda_graph_max_model_len or 8192, self.scratch,
                                                self.page_size),
                query_len=self.short_catch_up, device=self.device,
            )

    # -- subclass interface ------------------------------------------------------------------

    @abstractmethod
    def num_entries(self, req: DraftRequest) -> int:
        """Committed entries the draft KV must hold before expanding ``req`` (>= 1)."""

    @abstractmethod
    def entry_tokens(self, req: DraftRequest, start: int, end: int) -> list[int]:
        """Input tokens of entries ``start..end-1``."""

    def ready(self, req: DraftRequest, state: DraftReqState, num_entries: int) -> bool:
        """Whether ``req`` can be drafted now (EAGLE: its target features have arrived)."""
        return num_entries >= 1

    @abstractmethod
    def extend_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch-up forward over ``fb`` (the causal layout of
        :func:`~structspec.speculative.draft_batches.build_extend_batch` or
        :func:`~structspec.speculative.draft_batches.build_catch_up_batch`).

        Returns:
            ``(root_logp [b, V'] float32, root_state [b, ...] or None)`` for each request's
            last row (``fb.logits_indices``).
        """

    @abstractmethod
    def step_forward(
        self, fb: ForwardBatch, parent: torch.Tensor, root_state: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        """Frontier forward over ``fb`` (a
        :func:`~structspec.speculative.draft_batches.build_frontier_batch`); ``parent [B, k]``
        indexes the previous frontier (or the root). Returns ``[B, k, V']`` float32 log-probs."""

    #: ``[V']`` int64 target id of each draft-vocabulary id (EAGLE-3), None = identity.
    vocab_map: torch.Tensor | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    def state(self, request_id: str) -> DraftReqState:
        """The request's bookkeeping (created empty on first sight)."""
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = DraftReqState(row=self.page_table.add(()))
        return st

    def page_rows(self, request_ids: Sequence[str]) -> PageRows:
        """The requests' draft pages (known requests), as rows of :attr:`page_table`."""
        states = self.states
        return self.page_table.rows([states[r].row for r in request_ids])

    def page_table_host(self, request_ids: Sequence[str]) -> torch.Tensor:
        """``int64 [B, P]`` CPU page table of the requests' draft pages, ``P`` = the longest
        list (what :func:`~structspec.runner.batch_builder.page_table_tensor` builds from the
        lists)."""
        rows = self.page_rows(request_ids)
        width = self.page_table.width(rows.rows.tolist())
        return torch.from_numpy(rows.take(width))

    def ensure_capacity(self, st: DraftReqState, num_positions: int) -> bool:
        """Grow ``st.pages`` to cover ``num_positions``; False when the pool is full."""
        need = self.allocator.pages_for(num_positions) - len(st.pages)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        new = self.allocator.allocate(need)
        st.pages.extend(new)
        self.page_table.extend(st.row, new)
        return True

    def release(self, request_id: str) -> None:
        """Free the request's draft pages and state (unknown ids are ignored)."""
        st = self.states.pop(request_id, None)
        if st is not None:
            if st.pages:
                self.allocator.free(st.pages)
            self.page_table.remove(st.row)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        """Nothing to do: the committed history only grows, so entries ``0..kv_len-1`` stay
        valid and the next :meth:`propose` catches up on the rest (accepted drafts + bonus)."""

    # -- propose -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Draft a ``[B, N]`` tree per request on the device: catch-up, then the EAGLE-2
        expansion (:mod:`structspec.speculative.expansion`).

        Requests that cannot be drafted (draft pool full, EAGLE features missing) get a root
        plus padding nodes. On CUDA the drafting is one graph replay when a bucket fits.
        """
        return self._propose(reqs, self.num_nodes)

    @torch.inference_mode()
    def propose_sized(self, reqs: Sequence[DraftRequest], max_nodes: int) -> VerifyTree:
        """:meth:`propose` for a verify that keeps only the first ``max_nodes`` nodes: the
        expansion runs ``min(depth, max_nodes - 1)`` depths (a tree of ``max_nodes`` nodes
        holds no draft deeper than ``max_nodes - 1``), so a 2-node tree costs the catch-up
        forward alone and no expansion forward, and selects the ``max_nodes - 1`` best
        candidates of those depths (nodes past ``max_nodes`` are padding).

        Eager proposes only: a CUDA-graph propose replays the graph captured for the full
        tree (its draft forwards are nearly free there), so it is :meth:`propose`. Either
        way the draft KV of the committed entries is caught up exactly as by :meth:`propose`.
        """
        if self.graphs is not None or max_nodes >= self.num_nodes:
            return self.propose(reqs)
        return self._propose(reqs, max(max_nodes, 1))

    def _propose(self, reqs: Sequence[DraftRequest], max_nodes: int) -> VerifyTree:
        """:meth:`propose` with a node budget (``max_nodes < num_nodes``: eager only)."""
        plan = self._plan(reqs)
        if not plan.active:
            self.last_root_logp = None
            return _padded_tree(self._to_device(torch.tensor(plan.roots, dtype=torch.int64)),
                                self.num_nodes)
        g = self._graph_for(len(reqs), plan) if max_nodes >= self.num_nodes else None
        if g is not None and self.graphs is not None:
            tree = self.graphs.propose(g, self, reqs, plan)
        else:
            tree = self._propose_eager(reqs, plan, max_nodes)
        for i, e in zip(plan.active, plan.ends, strict=True):
            self.states[reqs[i].request_id].kv_len = e
        return tree

    def _plan(self, reqs: Sequence[DraftRequest]) -> ProposePlan:
        """Host bookkeeping: which requests are drafted, and their catch-up ranges (grows
        their draft pages to hold the catch-up and the expansion scratch)."""
        plan = ProposePlan(roots=[r.token_ids[-1] for r in reqs], active=[], starts=[], ends=[])
        for i, r in enumerate(reqs):
            st = self.state(r.request_id)
            e = self.num_entries(r)
            if st.kv_len > e:  # history shrank (should not happen): start over
                st.kv_len = 0
            if not self.ready(r, st, e) or not self.ensure_capacity(st, e + self.scratch + 1):
                continue
            plan.active.append(i)
            plan.starts.append(min(st.kv_len, e - 1))
            plan.ends.append(e)
        return plan

    def _graph_for(self, bsz: int, plan: ProposePlan) -> DraftGraph | None:
        """The graph bucket of this batch, or None (graphs off, or above the largest bucket)."""
        if self.graphs is None:
            return None
        need = self.allocator.pages_for(max(plan.ends) + self.scratch + 1)
        return self.graphs.lookup(bsz, need)

    def _propose_eager(self, reqs: Sequence[DraftRequest], plan: ProposePlan,
                       max_nodes: int | None = None) -> VerifyTree:
        """The eager propose: catch-up forward(s), then the expansion kernel by kernel
        (``max_nodes``: the node budget of :meth:`propose_sized`; None = the full tree)."""
        bsz, n = len(reqs), self.num_nodes
        budget = n if max_nodes is None else min(max_nodes, n)
        roots_dev = self._to_device(torch.tensor(plan.roots, dtype=torch.int64))
        act_reqs = [reqs[i] for i in plan.active]
        table_host = self.page_table_host([r.request_id for r in act_reqs])
        table = self._to_device(table_host)
        root_logp, root_state = self._catch_up(act_reqs, plan.starts, plan.ends, table_host)
        base_len = self._to_device(torch.tensor(plan.ends, dtype=torch.int64))
        tree = self.expand(root_logp, root_state, base_len, table, num_nodes=budget)
        tokens, parents = tree.tokens, tree.parents
        if budget < n:  # padding nodes past the budget keep propose's [B, N] shape
            pad = tokens.shape[0], n - budget
            tokens = torch.cat([tokens, tokens.new_full(pad, -1)], dim=1)
            parents = torch.cat([parents, parents.new_zeros(pad)], dim=1)
        if len(plan.active) < bsz:
            idx = self._to_device(torch.tensor(plan.active, dtype=torch.int64))
            full_tokens = torch.full((bsz, n), -1, dtype=torch.int64, device=self.device)
            full_parents = torch.zeros((bsz, n), dtype=torch.int64, device=self.device)
            tokens = full_tokens.index_copy(0, idx, tokens)
            parents = full_parents.index_copy(0, idx, parents)
            root_logp = root_logp.new_zeros((bsz, root_logp.shape[1])).index_copy(
                0, idx, root_logp)
        self.last_root_logp = root_logp
        tokens = tokens.clone()
        tokens[:, 0] = roots_dev
        return VerifyTree.from_parents(tokens, parents)

    def expand(
        self, root_logp: torch.Tensor, root_state: torch.Tensor | None, base_len: torch.Tensor,
        table: torch.Tensor, *, num_nodes: int | None = None,
    ) -> ExpandedTree:
        """EAGLE-2 expansion from the catch-up's output (device ops only, no host sync: what
        the propose graph records after its catch-up).

        Args:
            root_logp: ``[B, V']`` float32 log-probs of the root's children.
            root_state: ``[B, ...]`` per-request state from :meth:`extend_forward` or None.
            base_len: ``[B]`` int64 committed draft entries (the scratch starts there).
            table: ``[B, P]`` int64 device page table covering ``base_len + scratch``.
            num_nodes: tree size to select (None = :attr:`num_nodes`); a smaller one also
                stops the expansion at depth ``num_nodes - 1`` (no draft of such a tree can
                be deeper), one draft forward per depth fewer.
        """
        n = self.num_nodes if num_nodes is None else num_nodes
        depth = max(1, min(self.depth, n - 1))

        layouts: list[FrontierLayout] = []  # the steps' shared layout, built at step 1

        def step_fn(step: int, tokens: torch.Tensor, parent: torch.Tensor,
                    scratch_mask: torch.Tensor) -> torch.Tensor:
            if not layouts:
                layouts.append(frontier_layout(base_len, scratch_mask.shape[2], table,
                                               page_size=self.page_size))
            fb = build_frontier_batch(tokens, step, scratch_mask, layouts[0])
            return self.step_forward(fb, parent, root_state, step)

        return expand_tree(root_logp, step_fn, topk=self.topk, depth=depth,
                           num_nodes=n, vocab_map=self.vocab_map)

    def write_prefix(
        self, reqs: Sequence[DraftRequest], starts: Sequence[int], ends: Sequence[int]
    ) -> None:
        """Eager causal extend of entries ``starts[b]..ends[b]-1`` (``ends > starts``): draft
        KV only (the long catch-ups' heads before a graph replay handles their last rows)."""
        table = self.page_table_host([r.request_id for r in reqs])
        fb = build_extend_batch(
            [self.entry_tokens(r, s, e) for r, s, e in zip(reqs, starts, ends, strict=True)],
            list(starts), table, page_size=self.page_size, device=self.device,
            staging=self.staging)
        self.extend_forward(fb)  # its log-probs are not needed

    @torch.inference_mode()
    def warmup_cuda_graphs(
        self, batch_sizes: Sequence[int] | None = None, kv_lens: Sequence[int] | None = None
    ) -> int:
        """Capture propose graphs ahead of time (e.g. before timing), dummy rows only (their
        KV writes go to the sink page). No-op without graphs.

        Args:
            batch_sizes: batch sizes to capture the buckets of (default: all buckets).
            kv_lens: committed lengths (draft entries) to capture the page buckets of; each
                needs ``kv_len + scratch + 1`` positions (default: all buckets).

        Returns:
            The number of graphs captured by this call.
        """
        if self.graphs is None:
            return 0
        pages = None
        if kv_lens is not None:
            pages = [self.allocator.pages_for(L + self.scratch + 1) for L in kv_lens]
        return self.graphs.warmup(self, self.allocator.pages_for(self.scratch + 2),
                                  batch_sizes=batch_sizes, pages=pages)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a small CPU tensor, any shape and dtype) on the drafter's device: staged
        through :attr:`staging` on CUDA (non-blocking, no host sync), a plain copy on CPU."""
        return to_device(host, self.device, self.staging)

    def _catch_up(
        self, reqs: list[DraftRequest], starts: list[int], ends: list[int],
        table_host: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed entries ``starts[b]..ends[b]-1``; at most two forwards (short rows, long rows)."""
        lens = [e - s for s, e in zip(starts, ends, strict=True)]
        groups = [[i for i, q in enumerate(lens) if q <= self.short_catch_up],
                  [i for i, q in enumerate(lens) if q > self.short_catch_up]]
        groups = [g for g in groups if g]
        outs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for g in groups:
            fb = build_extend_batch(
                [self.entry_tokens(reqs[i], starts[i], ends[i]) for i in g],
                [starts[i] for i in g], table_host[g], page_size=self.page_size,
                device=self.device, staging=self.staging,
            )
            outs.append(self.extend_forward(fb))
        if len(outs) == 1:
            return outs[0]
        order = [i for g in groups for i in g]
        inv = torch.empty(len(order), dtype=torch.int64)
        inv[torch.tensor(order)] = torch.arange(len(order))
        inv_dev = self._to_device(inv)
        logp = torch.cat([o[0] for o in outs]).index_select(0, inv_dev)
        states = [o[1] for o in outs if o[1] is not None]
        state = None
        if len(states) == len(outs):
            state = torch.cat(states).index_select(0, inv_dev)
        return logp, state


def _padded_tree(roots: torch.Tensor, n: int) -> VerifyTree:
    """Root plus ``n - 1`` padding nodes per request."""
    bsz = roots.shape[0]
    tokens = torch.full((bsz, n), -1, dtype=torch.int64, device=roots.device)
    tokens[:, 0] = roots
    parents = torch.zeros_like(tokens)
    parents[:, 0] = -1
    return VerifyTree.from_parents(tokens, parents)
