"""Shared machinery of the model-based drafters (draft model, EAGLE): EAGLE-2 tree expansion,
draft-side KV bookkeeping and the batched catch-up / frontier forwards.

Tree expansion follows EAGLE-2 (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees", arXiv:2406.16858) in the form sglang implements it (see
``../shared/reference/sglang-grammar-spec.md`` section 2.1, written from that description):

* step 0: the ``topk`` most likely children of the root (node 0, the last committed token),
  scored by their log-probability;
* steps ``1 .. depth-1``: ONE batched draft forward over every request's ``topk`` frontier
  nodes (tree attention: each frontier node sees the committed prefix, its ancestors and
  itself); each frontier node proposes its ``topk`` children, scored by the cumulative
  log-probability of their path; the ``topk`` best of those ``topk * topk`` form the next
  frontier;
* finally the ``N - 1`` candidates with the highest cumulative score over all steps become
  nodes 1..N-1, ordered by candidate index (parents before children).

Cumulative scores are sums of log-probabilities (the log of EAGLE-2's product of
probabilities). Ranking is by ``(score descending, candidate index ascending)``; since a child's
score never exceeds its parent's (a log-probability is ``<= 0`` and float rounding of
``x + l`` with ``l <= 0`` never exceeds ``x``) and a parent's candidate index is smaller than
its children's, every selected node's parent ranks strictly earlier, so the selected set is
ancestor-closed and ties are deterministic.

Draft KV layout per request (pages from the drafter's own :class:`PageAllocator`): the drafter
owns ``E`` *committed entries* at positions ``0..E-1`` (draft model: one per history token;
EAGLE: one per (token, target feature) pair, see :mod:`structspec.speculative.eagle`), followed by a
scratch area of ``(depth - 1) * topk`` slots where frontier node ``j`` of step ``s`` writes its
KV at position ``E + (s - 1) * topk + j`` (its rotary position is ``E + s - 1``). After verify
the committed history only grows by appending, so entries ``0..kv_len-1`` stay valid and the
next propose re-feeds entries ``kv_len..E-1`` (at least the last one, whose output seeds the
root's children) in one batched causal *catch-up* forward.

On CUDA the catch-up and the whole expansion of a propose are one CUDA-graph replay per
(batch, page-table width) bucket; see :mod:`structspec.speculative.draft_graph`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.kvcache.allocator import PageAllocator, slots_for_positions
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.runner.batch_builder import page_table_tensor
from structspec.runner.cuda_graph import DEFAULT_BATCH_SIZES
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.draft_graph import (
    DraftGraph,
    DraftGraphCache,
    ProposePlan,
    draft_page_buckets,
)

#: ``step_fn(step, tokens, parent, scratch_mask) -> logp``: run the draft over the frontier of
#: ``step`` (1-based): ``tokens [B, k]`` int64 (target vocabulary), ``parent [B, k]`` int64
#: index of each node's parent in the previous frontier (step 1: zeros, the root),
#: ``scratch_mask [B, k, S]`` bool scratch columns each node may see; returns ``[B, k, V']``
#: float32 log-probabilities of the nodes' children (draft vocabulary).
StepFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExpandedTree:
    """Result of :func:`expand_tree`, on the device of the inputs.

    Attributes:
        tokens: ``[B, N]`` int64; column 0 is -1 here (the caller puts the root token there);
            -1 for padding nodes.
        parents: ``[B, N]`` int64 parent node index (-1 for node 0, 0 for padding nodes).
        scores: ``[B, N]`` float32 cumulative log-probability of each node (0 for node 0,
            ``-inf`` for padding).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor


def rank_order(scores: torch.Tensor) -> torch.Tensor:
    """Candidate indices sorted by ``(score descending, index ascending)``.

    Args:
        scores: ``[B, C]`` float.

    Returns:
        ``[B, C]`` int64. NaN scores rank last.
    """
    clean = torch.nan_to_num(scores.float(), nan=float("-inf"))
    # A stable ascending sort of the negated scores keeps equal scores in index order.
    return torch.sort(-clean, dim=1, stable=True).indices


def select_top_nodes(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> ExpandedTree:
    """Pick the ``num_nodes - 1`` best candidates and lay them out as tree nodes 1..N-1.

    Args:
        scores: ``[B, C]`` float32 cumulative log-probabilities of all candidates.
        tokens: ``[B, C]`` int64 candidate tokens.
        parents: ``[B, C]`` int64 candidate index of each candidate's parent (-1 = the root);
            ``parents[b, c] < c`` and ``scores[b, c] <= scores[b, parents[b, c]]``.
        num_nodes: ``N`` (node 0 included).

    Returns:
        :class:`ExpandedTree` with ``N`` columns; when ``C < N - 1`` the tail is padding.
    """
    bsz, c = scores.shape
    device = scores.device
    m = min(num_nodes - 1, c)
    sel = rank_order(scores)[:, :m].sort(dim=1).values  # [B, m], ancestry order
    sel_tokens = torch.gather(tokens, 1, sel)
    sel_scores = torch.gather(scores.float(), 1, sel)
    par_cand = torch.gather(parents, 1, sel)
    # A selected parent's node index is its rank among the selected candidates, plus 1.
    par_node = torch.searchsorted(sel.contiguous(), par_cand.clamp(min=0).contiguous()) + 1
    par_node = torch.where(par_cand < 0, torch.zeros_like(par_node), par_node)
    out_tokens = torch.full((bsz, num_nodes), -1, dtype=torch.int64, device=device)
    out_parents = torch.zeros((bsz, num_nodes), dtype=torch.int64, device=device)
    out_scores = torch.full((bsz, num_nodes), float("-inf"), dtype=torch.float32, device=device)
    out_tokens[:, 1 : m + 1] = sel_tokens
    out_parents[:, 1 : m + 1] = par_node
    out_scores[:, 1 : m + 1] = sel_scores
    out_parents[:, 0] = -1
    out_scores[:, 0] = 0.0
    return ExpandedTree(tokens=out_tokens, parents=out_parents, scores=out_scores)


def expand_tree(
    root_logp: torch.Tensor,
    step_fn: StepFn,
    *,
    topk: int,
    depth: int,
    num_nodes: int,
    vocab_map: torch.Tensor | None = None,
) -> ExpandedTree:
    """EAGLE-2 dynamic tree expansion (see the module docstring). No host syncs.

    Args:
        root_logp: ``[B, V']`` float32 log-probabilities of the root's children (draft vocab).
        step_fn: runs one batched draft forward over a frontier (:data:`StepFn`).
        topk: children kept per expanded node and frontier width (``>= 1``).
        depth: expansion depth (``>= 1``): drafts reach depth ``depth``; ``depth - 1`` calls
            of ``step_fn``.
        num_nodes: ``N``, tree size including node 0.
        vocab_map: optional ``[V']`` int64 target token id of each draft-vocabulary id
            (EAGLE-3's reduced vocabulary); None = identity.

    Returns:
        :class:`ExpandedTree` ``[B, N]``.
    """
    bsz = root_logp.shape[0]
    device = root_logp.device
    k = min(topk, root_logp.shape[1])
    scratch = (depth - 1) * k

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids if vocab_map is None else vocab_map[ids]

    top = torch.topk(root_logp.float(), k, dim=1)
    scores = [top.values]  # per step: [B, k] then [B, k*k]
    tokens = [to_target(top.indices)]
    parents = [torch.full((bsz, k), -1, dtype=torch.int64, device=device)]
    front_scores = top.values  # [B, k]
    front_tokens = tokens[0]  # [B, k]
    front_cand = torch.arange(k, device=device).expand(bsz, k)  # candidate index of each node
    front_parent = torch.zeros((bsz, k), dtype=torch.int64, device=device)
    cols = torch.arange(scratch, device=device)
    front_anc = torch.zeros((bsz, k, scratch), dtype=torch.bool, device=device)
    offset = k
    for step in range(1, depth):
        # Frontier node j of this step writes scratch column (step-1)*k + j.
        own = cols.view(1, 1, -1) == ((step - 1) * k + torch.arange(k, device=device)).view(1, k, 1)
        front_anc = front_anc | own
        logp = step_fn(step, front_tokens, front_parent, front_anc)  # [B, k, V']
        child = torch.topk(logp.float(), k, dim=2)
        cum = front_scores.unsqueeze(2) + child.values  # [B, k, k]
        flat_scores = cum.reshape(bsz, k * k)
        flat_tokens = to_target(child.indices).reshape(bsz, k * k)
        flat_parents = front_cand.unsqueeze(2).expand(bsz, k, k).reshape(bsz, k * k)
        scores.append(flat_scores)
        tokens.append(flat_tokens)
        parents.append(flat_parents)
        keep = rank_order(flat_scores)[:, :k]  # [B, k] local indices of the new frontier
        front_scores = torch.gather(flat_scores, 1, keep)
        front_tokens = torch.gather(flat_tokens, 1, keep)
        front_parent = torch.div(keep, k, rounding_mode="floor")
        front_cand = offset + keep
        front_anc = torch.gather(front_anc, 1, front_parent.unsqueeze(2).expand(bsz, k, scratch))
        offset += k * k
    return select_top_nodes(
        torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), num_nodes
    )


# ----------------------------------------------------------------------------- forward batches


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device``; pinned + ``non_blocking`` for CUDA (the copy is stream
    ordered before the kernels that read it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_extend_batch(
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    page_table: torch.Tensor,
    *,
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Causal extend: request b appends ``token_ids[b]`` at positions ``starts[b]..`` after
    ``starts[b]`` entries already in the draft KV (a prefill when ``starts[b] == 0``).

    Args:
        token_ids: per request, the non-empty tokens to append.
        starts: per request, the number of entries already cached.
        page_table: ``[B, P]`` int64 host page table covering ``starts[b] + len(token_ids[b])``.

    Returns:
        A ForwardBatch on ``device`` (``[B, Q]`` queries over ``[B, P * page_size]`` KV slots);
        ``logits_indices`` = the flat row of each request's last new token.
    """
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    start = torch.tensor(list(starts), dtype=torch.int64)
    bsz, q = len(token_ids), int(lens.max())
    input_ids = torch.zeros((bsz, q), dtype=torch.int64)
    for i, t in enumerate(token_ids):
        input_ids[i, : len(t)] = torch.tensor(list(t), dtype=torch.int64)
    col = torch.arange(q).expand(bsz, q)
    valid = col < lens.unsqueeze(1)
    positions = torch.where(valid, start.unsqueeze(1) + col, torch.zeros_like(col))
    out_slots = torch.where(valid, slots_for_positions(page_table, positions, page_size), 0)
    kv_len = int(page_table.shape[1]) * page_size
    kv_pos = torch.arange(kv_len).expand(bsz, kv_len)
    total = (start + lens).unsqueeze(1)
    kv_slots = slots_for_positions(page_table, torch.minimum(kv_pos, total - 1), page_size)
    kv_slots = torch.where(kv_pos < total, kv_slots, torch.zeros_like(kv_slots))
    mask = (kv_pos.unsqueeze(1) <= positions.unsqueeze(2)) & valid.unsqueeze(2)
    mask[:, :, 0] |= ~valid  # padding rows attend to column 0 only
    logits_indices = torch.arange(bsz) * q + lens - 1
    return ForwardBatch(
        input_ids=host_to_device(input_ids, device),
        positions=host_to_device(positions, device),
        out_slots=host_to_device(out_slots, device),
        kv_slots=host_to_device(kv_slots, device),
        attn_mask=host_to_device(mask, device),
        logits_indices=host_to_device(logits_indices, device),
    )


def build_frontier_batch(
    tokens: torch.Tensor,
    base_len: torch.Tensor,
    step: int,
    scratch_mask: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> ForwardBatch:
    """One expansion step's draft forward over the frontier (all on the device, no syncs).

    Frontier node j of step ``s`` (depth ``s``) has rotary position ``base_len + s - 1`` and
    writes its KV at position ``base_len + (s - 1) * k + j``; it sees the ``base_len``
    committed entries and the scratch columns set in ``scratch_mask`` (its ancestors and
    itself).

    Args:
        tokens: ``[B, k]`` int64 frontier tokens.
        base_len: ``[B]`` int64 committed draft entries per request.
        step: 1-based expansion step.
        scratch_mask: ``[B, k, S]`` bool, S = scratch columns.
        page_table: ``[B, P]`` int64, covering ``base_len + S`` positions.
    """
    bsz, k = tokens.shape
    device = tokens.device
    scratch = scratch_mask.shape[2]
    node = torch.arange(k, device=device)
    out_pos = base_len.unsqueeze(1) + (step - 1) * k + node
    out_slots = slots_for_positions(page_table, out_pos, page_size)
    kv_len = int(page_table.shape[1]) * page_size
    kv_pos = torch.arange(kv_len, device=device).expand(bsz, kv_len)
    total = (base_len + scratch).unsqueeze(1)
    kv_slots = slots_for_positions(page_table, torch.minimum(kv_pos, total - 1), page_size)
    kv_slots = torch.where(kv_pos < total, kv_slots, torch.zeros_like(kv_slots))
    prefix = kv_pos < base_len.unsqueeze(1)
    col = kv_pos - base_len.unsqueeze(1)
    in_scratch = (col >= 0) & (col < scratch)
    seen = torch.gather(
        scratch_mask, 2, col.clamp(0, max(scratch - 1, 0)).unsqueeze(1).expand(bsz, k, kv_len)
    )
    mask = prefix.unsqueeze(1) | (seen & in_scratch.unsqueeze(1))
    return ForwardBatch(
        input_ids=tokens,
        positions=(base_len + step - 1).unsqueeze(1).expand(bsz, k).contiguous(),
        out_slots=out_slots,
        kv_slots=kv_slots,
        attn_mask=mask,
        logits_indices=None,
    )


# ----------------------------------------------------------------------------- drafter base


def default_draft_pages(spec: SpecConfig, target: Any, max_batch_size: int) -> int:
    """Draft KV pages: the target's page count plus, per request, scratch pages for the
    deepest expansion (``(depth - 1) * topk + 1`` frontier slots) and one spare."""
    page_size = int(target.page_size)
    scratch_pages = -(-((spec.depth - 1) * spec.topk + 1) // page_size) + 1
    return int(target.kv_pool.num_pages) + max_batch_size * scratch_pages


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
        opts["cuda_graph_max_model_len"] = max(graphs.page_buckets) * int(target.page_size)
    return opts


@dataclass
class DraftReqState:
    """Host bookkeeping of one request in a model-based drafter.

    Attributes:
        pages: the request's pages in the drafter's KV pool.
        kv_len: committed entries with valid draft KV (positions ``0..kv_len-1``).
        feat_len: positions with a stored target feature (EAGLE only).
    """

    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    feat_len: int = 0


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
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.allocator = PageAllocator(kv_pool.num_pages, kv_pool.page_size)
        self.scratch = (self.depth - 1) * self.topk
        self.states: dict[str, DraftReqState] = {}
        #: ``[B, V']`` float32 log-probs of the root's children from the last propose, row b =
        #: request b (tests and debugging; rows of requests that were not drafted are
        #: undefined; None after a graph propose unless :attr:`graph_keeps_root_logp`).
        self.last_root_logp: torch.Tensor | None = None
        #: ``max(catch-up length)`` up to which requests share one catch-up forward; longer
        #: ones (first sight of a prompt) run in a second forward so short rows are not padded.
        #: Also the graphs' catch-up width ``Q``.
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
        """Catch-up forward over ``fb`` (a :func:`build_extend_batch`).

        Returns:
            ``(root_logp [b, V'] float32, root_state [b, ...] or None)`` for each request's
            last row (``fb.logits_indices``).
        """

    @abstractmethod
    def step_forward(
        self, fb: ForwardBatch, parent: torch.Tensor, root_state: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        """Frontier forward over ``fb`` (a :func:`build_frontier_batch`); ``parent [B, k]``
        indexes the previous frontier (or the root). Returns ``[B, k, V']`` float32 log-probs."""

    vocab_map: torch.Tensor | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    def state(self, request_id: str) -> DraftReqState:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = DraftReqState()
        return st

    def ensure_capacity(self, st: DraftReqState, num_positions: int) -> bool:
        """Grow ``st.pages`` to cover ``num_positions``; False when the pool is full."""
        need = self.allocator.pages_for(num_positions) - len(st.pages)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        st.pages.extend(self.allocator.allocate(need))
        return True

    def release(self, request_id: str) -> None:
        """Free the request's draft pages and state (unknown ids are ignored)."""
        st = self.states.pop(request_id, None)
        if st is not None and st.pages:
            self.allocator.free(st.pages)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        """Nothing to do: the committed history only grows, so entries ``0..kv_len-1`` stay
        valid and the next :meth:`propose` catches up on the rest (accepted drafts + bonus)."""

    # -- propose -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Draft a ``[B, N]`` tree per request on the device (see the module docstring).

        Requests that cannot be drafted (draft pool full, EAGLE features missing) get a root
        plus padding nodes. On CUDA the drafting is one graph replay when a bucket fits.
        """
        plan = self._plan(reqs)
        if not plan.active:
            self.last_root_logp = None
            return _padded_tree(host_to_device(torch.tensor(plan.roots, dtype=torch.int64),
                                               self.device), self.num_nodes)
        g = self._graph_for(len(reqs), plan)
        tree = (self.graphs.propose(g, self, reqs, plan)  # type: ignore[union-attr]
                if g is not None else self._propose_eager(reqs, plan))
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

    def _propose_eager(self, reqs: Sequence[DraftRequest], plan: ProposePlan) -> VerifyTree:
        """The eager propose: catch-up forward(s), then the expansion kernel by kernel."""
        bsz, n = len(reqs), self.num_nodes
        roots_dev = host_to_device(torch.tensor(plan.roots, dtype=torch.int64), self.device)
        act_reqs = [reqs[i] for i in plan.active]
        pages = [self.states[r.request_id].pages for r in act_reqs]
        table_host = page_table_tensor(pages, torch.device("cpu"))
        table = host_to_device(table_host, self.device)
        root_logp, root_state = self._catch_up(act_reqs, plan.starts, plan.ends, table_host)
        base_len = host_to_device(torch.tensor(plan.ends, dtype=torch.int64), self.device)
        tree = self.expand(root_logp, root_state, base_len, table)
        tokens, parents = tree.tokens, tree.parents
        if len(plan.active) < bsz:
            idx = host_to_device(torch.tensor(plan.active, dtype=torch.int64), self.device)
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
        table: torch.Tensor,
    ) -> ExpandedTree:
        """EAGLE-2 expansion from the catch-up's output (device ops only, no host sync: what
        the propose graph records after its catch-up).

        Args:
            root_logp: ``[B, V']`` float32 log-probs of the root's children.
            root_state: ``[B, ...]`` per-request state from :meth:`extend_forward` or None.
            base_len: ``[B]`` int64 committed draft entries (the scratch starts there).
            table: ``[B, P]`` int64 device page table covering ``base_len + scratch``.
        """

        def step_fn(step: int, tokens: torch.Tensor, parent: torch.Tensor,
                    scratch_mask: torch.Tensor) -> torch.Tensor:
            fb = build_frontier_batch(tokens, base_len, step, scratch_mask, table,
                                      page_size=self.page_size)
            return self.step_forward(fb, parent, root_state, step)

        return expand_tree(root_logp, step_fn, topk=self.topk, depth=self.depth,
                           num_nodes=self.num_nodes, vocab_map=self.vocab_map)

    def write_prefix(
        self, reqs: Sequence[DraftRequest], starts: Sequence[int], ends: Sequence[int]
    ) -> None:
        """Eager causal extend of entries ``starts[b]..ends[b]-1`` (``ends > starts``): draft
        KV only (the long catch-ups' heads before a graph replay handles their last rows)."""
        table = page_table_tensor([self.states[r.request_id].pages for r in reqs],
                                  torch.device("cpu"))
        fb = build_extend_batch(
            [self.entry_tokens(r, s, e) for r, s, e in zip(reqs, starts, ends, strict=True)],
            list(starts), table, page_size=self.page_size, device=self.device)
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
                device=self.device,
            )
            outs.append(self.extend_forward(fb))
        if len(outs) == 1:
            return outs[0]
        order = [i for g in groups for i in g]
        inv = torch.empty(len(order), dtype=torch.int64)
        inv[torch.tensor(order)] = torch.arange(len(order))
        inv_dev = host_to_device(inv, self.device)
        logp = torch.cat([o[0] for o in outs]).index_select(0, inv_dev)
        states = [o[1] for o in outs]
        state = None
        if all(s is not None for s in states):
            state = torch.cat(states).index_select(0, inv_dev)  # type: ignore[arg-type]
        return logp, state


def _padded_tree(roots: torch.Tensor, n: int) -> VerifyTree:
    """Root plus ``n - 1`` padding nodes per request."""
    bsz = roots.shape[0]
    tokens = torch.full((bsz, n), -1, dtype=torch.int64, device=roots.device)
    tokens[:, 0] = roots
    parents = torch.zeros_like(tokens)
    parents[:, 0] = -1
    return VerifyTree.from_parents(tokens, parents)
