"""CUDA graphs of the model-based drafters' propose: catch-up + EAGLE-2 expansion, one replay.

An eager propose of a ``D``-layer draft launches ``depth`` forwards (a catch-up, then
``depth - 1`` frontier forwards) plus the top-k / sort / tree bookkeeping: hundreds of kernel
launches, ~50 us of host time each on the Triton path. Here the whole propose of the common
case is one CUDA graph per bucket ``(B, P)``:

* ``B``: batch-size bucket; rows past the batch (and requests that are not drafted this step)
  are *dummy rows*;
* ``P``: page-table width, ``P * page_size`` a KV-length bucket (powers of two from 256 tokens,
  the last one widened to hold the expansion scratch).

``topk``, ``depth``, ``N`` and the catch-up width ``Q = TreeDrafter.short_catch_up`` are fixed
per drafter. Graphs are captured lazily on first use (or ahead of time,
:meth:`TreeDrafter.warmup_cuda_graphs`) into one memory pool per drafter; a batch above the
largest ``B`` bucket or a page table wider than the largest ``P`` bucket runs eagerly.

Static inputs: one flat int64 device buffer ``roots [B] | start [B] | qlen [B] | tokens [B, Q]
| page_table [B, P]``, filled by ONE pinned host buffer (:func:`stage_propose_inputs`) and ONE
non-blocking H2D copy per propose (:class:`~structspec.staging.PinnedRing`). Everything else (catch-up slots,
positions, masks, ``logits_indices``, the frontier batches) is built inside the graph by
:func:`~structspec.speculative.draft_batches.build_catch_up_batch` and
:func:`~structspec.speculative.draft_batches.build_frontier_batch`.

Row kinds:

* real row: appends entries ``start .. start + qlen - 1`` (``1 <= qlen <= Q``) after ``start``
  cached entries; query rows past ``qlen`` are padding rows (write slot 0, attend column 0),
  exactly as :func:`~structspec.speculative.draft_batches.build_extend_batch` lays them out;
* dummy row (``qlen = 0``: batch padding, or a request that is not drafted this step): treated
  as one token at position 0 with an all-zero page-table row, so its catch-up and frontier KV
  writes all land in page 0, the sink that :class:`~structspec.kvcache.allocator.PageAllocator`
  never hands out; it attends only sink columns, and its tree is replaced by root + padding.
  Real rows never attend page 0 (their columns below ``base_len + scratch`` map to their own
  pages), so dummy rows cannot leak into real outputs.

Long catch-ups (``qlen > Q``: first sight of a prompt) are split: their first ``qlen - Q``
entries run eagerly (one causal extend forward, prefill-like and rare) before the replay, on
the same stream, and the graph catches up on the last ``Q``. So a batch mixing new and running
requests still drafts with one replay.

Static outputs (the graph's pool): the tree ``[B, N]`` (:class:`VerifyTree` fields, built by
:meth:`VerifyTree.from_parents` inside the graph, and its links packed ``[4, B, N]`` for the
grammar's host copy, ``VerifyTree.host_links``) and, when
``TreeDrafter.graph_keeps_root_logp``, ``root_logp [B, V']`` float32. A propose returns views of
rows ``[:batch]``: valid until the next propose.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.kvcache.page_table import PageRows
from structspec.layers.forward_batch import ForwardBatch
from structspec.runner.cuda_graph import capture_after_warmup, kv_len_buckets, pick_bucket
from structspec.speculative.base import DraftRequest
from structspec.speculative.draft_batches import build_catch_up_batch
from structspec.speculative.expansion import ExpandedTree
from structspec.staging import HostRing, PinnedRing


class GraphDrafter(Protocol):
    """What the propose graphs need of their drafter
    (:class:`~structspec.speculative.tree_drafter.TreeDrafter` is the one implementation; a
    protocol, so that this module does not import it back).

    Attributes:
        page_size: KV slots per draft page.
        graph_keeps_root_logp: keep ``root_logp`` as a static graph output.
        last_root_logp: ``[B, V']`` float32 of the last propose, or None (set here).
    """

    page_size: int
    graph_keeps_root_logp: bool
    last_root_logp: torch.Tensor | None

    def extend_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch-up forward: ``(root_logp [B, V'] float32, root_state [B, ...] or None)``."""
        ...

    def expand(self, root_logp: torch.Tensor, root_state: torch.Tensor | None,
               base_len: torch.Tensor, table: torch.Tensor) -> ExpandedTree:
        """EAGLE-2 expansion from the catch-up's output (device ops only)."""
        ...

    def page_rows(self, request_ids: Sequence[str]) -> PageRows:
        """The requests' draft pages, as rows of the drafter's page table."""
        ...

    def write_prefix(self, reqs: Sequence[DraftRequest], starts: Sequence[int],
                     ends: Sequence[int]) -> None:
        """Eager causal extend of entries ``starts[b]..ends[b]-1`` (draft KV only)."""
        ...

    def entry_tokens(self, req: DraftRequest, start: int, end: int) -> list[int]:
        """Input tokens of entries ``start..end-1``."""
        ...


@dataclass
class ProposePlan:
    """Host bookkeeping of one propose (shared by the eager and the graph paths).

    Attributes:
        roots: per request, the last committed token (node 0).
        active: indices of the requests drafted this step (ready, pages available).
        starts: per active request, entries already in the draft KV before this propose.
        ends: per active request, entries after its catch-up (the expansion's ``base_len``).
    """

    roots: list[int]
    active: list[int]
    starts: list[int]
    ends: list[int]


class DraftGraph:
    """Static buffers, and once captured the graph, of one ``(B, P)`` bucket.

    Attributes:
        bsz, pages, query_len: the bucket's ``B``, ``P`` and the drafter's ``Q``.
        ints: ``[B * (3 + Q + P)]`` int64 device buffer, the views below (row-major).
        roots: ``[B]`` node-0 tokens.  start: ``[B]``.  qlen: ``[B]`` (0 = dummy row).
        tokens: ``[B, Q]``.  page_table: ``[B, P]``.
        tree: static output tree ``[B, N]`` (after capture, or after an eager :meth:`run`).
        root_logp: ``[B, V']`` float32 static output, or None (see the module docstring).
    """

    def __init__(self, bsz: int, pages: int, query_len: int, device: torch.device) -> None:
        self.bsz, self.pages, self.query_len = bsz, pages, query_len
        q = query_len
        self.ints = torch.zeros(bsz * (3 + q + pages), dtype=torch.int64, device=device)
        self.roots = self.ints[:bsz]
        self.start = self.ints[bsz : 2 * bsz]
        self.qlen = self.ints[2 * bsz : 3 * bsz]
        o = 3 * bsz
        self.tokens = self.ints[o : o + bsz * q].view(bsz, q)
        o += bsz * q
        self.page_table = self.ints[o:].view(bsz, pages)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tree: VerifyTree | None = None
        self.root_logp: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def reset_dummy(self) -> None:
        """Make every row a dummy row (a device op; before an ahead-of-time capture)."""
        self.ints.zero_()

    def forward(self, drafter: GraphDrafter) -> tuple[torch.Tensor, VerifyTree]:
        """The whole propose on the static inputs, run eagerly (what the graph records).

        Returns:
            ``(root_logp [B, V'] float32, tree [B, N])``, fresh tensors on the buffers' device.
        """
        fb = build_catch_up_batch(self.tokens, self.start, self.qlen, self.page_table,
                                  page_size=drafter.page_size)
        root_logp, root_state = drafter.extend_forward(fb)
        base_len = self.start + self.qlen.clamp(min=1)
        expanded = drafter.expand(root_logp, root_state, base_len, self.page_table)
        active = (self.qlen > 0).unsqueeze(1)
        tokens = torch.where(active, expanded.tokens, torch.full_like(expanded.tokens, -1))
        tokens[:, 0] = self.roots
        parents = torch.where(active, expanded.parents, torch.zeros_like(expanded.parents))
        tree = VerifyTree.from_parents(tokens, parents)
        # The grammar's host copy of the tree, packed here (one kernel inside the replay):
        # staged after the replay as one contiguous D2H copy, where packing it per step
        # cost the host a stack launch, four record_streams and their bookkeeping
        tree.host_links = torch.stack([tree.next_token, tree.next_sibling, tree.draft_tokens,
                                       tree.parents])
        return root_logp, tree

    def capture(self, drafter: GraphDrafter, pool: tuple, keep_root_logp: bool) -> None:
        """Warm up once on a side stream, then capture into ``pool``. Syncs the device (only
        here, never in replay). The warm-up writes the same KV the replay will write."""
        # (the staged inputs and any eager catch-up prefix come before the warm-up)
        graph, (root_logp, self.tree) = capture_after_warmup(lambda: self.forward(drafter),
                                                             pool)
        # A dropped root_logp's pool block may be reused by later captures: this graph still
        # writes it, harmlessly, since nobody reads it.
        self.root_logp = root_logp if keep_root_logp else None
        self.graph = graph

    def replay(self) -> None:
        """Launch the graph on the current stream (no host sync)."""
        assert self.graph is not None, "capture() first"
        self.graph.replay()


def stage_propose_inputs(out: np.ndarray, g: DraftGraph, drafter: GraphDrafter,
                         reqs: Sequence[DraftRequest], plan: ProposePlan,
                         starts: Sequence[int]) -> None:
    """Write ``g``'s static inputs for one propose into ``out`` (the host side of its one H2D
    copy): ``roots [B] | start [B] | qlen [B] | tokens [B, Q] | page_table [B, P]`` with the
    bucket's ``B``, ``Q``, ``P``; dummy rows (padding, undrafted requests) all 0.

    Built with numpy over the batch: only each drafted request's entry tokens (at most ``Q``)
    are gathered per request; its pages come from the drafter's page table in one gather (a
    flat Python list of every field, converted at once, cost ~B * P int conversions a step).

    Args:
        out: ``int64 [B * (3 + Q + P)]`` host array (the pinned buffer's numpy view).
        g: the bucket (its ``bsz``, ``query_len``, ``pages``).
        reqs, plan: the propose's requests and plan.
        starts: per active request, the first entry the graph catches up on (a long
            catch-up's earlier entries were written eagerly).
    """
    gb, q, width = g.bsz, g.query_len, g.pages
    out[:] = 0
    out[: len(plan.roots)] = plan.roots
    if not plan.active:
        return
    active = np.asarray(plan.active, dtype=np.int64)
    start = np.asarray(starts, dtype=np.int64)
    qlen = np.asarray(plan.ends, dtype=np.int64) - start
    out[gb + active] = start
    out[2 * gb + active] = qlen
    tokens = out[3 * gb : (3 + q) * gb].reshape(gb, q)
    rows = np.zeros((len(active), q), dtype=np.int64)
    rows[np.arange(q) < qlen[:, None]] = list(itertools.chain.from_iterable(
        drafter.entry_tokens(reqs[i], s, e)
        for i, s, e in zip(plan.active, starts, plan.ends, strict=True)))
    tokens[active] = rows
    table = out[(3 + q) * gb :].reshape(gb, width)
    table[active] = drafter.page_rows([reqs[i].request_id for i in plan.active]).take(width)


def draft_page_buckets(max_model_len: int, scratch: int, page_size: int) -> tuple[int, ...]:
    """Page-table widths: the target's KV-length buckets in pages, the last one widened by the
    expansion scratch (a request of ``E`` entries needs ``E + scratch + 1`` positions)."""
    pages = [-(-length // page_size) for length in kv_len_buckets(max_model_len)]
    pages[-1] = max(pages[-1], -(-(max_model_len + scratch + 1) // page_size))
    return tuple(sorted(set(pages)))


class DraftGraphCache:
    """A drafter's propose graphs: bucket lookup, staging, lazy capture, one memory pool.

    On CUDA graphs are captured and replayed. On CPU (tests) the same code path runs with
    :meth:`DraftGraph.forward` executed eagerly on the static buffers instead of a replay.

    Args:
        batch_sizes: batch-size buckets.
        page_buckets: page-table-width buckets (see :func:`draft_page_buckets`).
        query_len: ``Q``, the catch-up width (``TreeDrafter.short_catch_up``).
        device: where the drafter lives.
    """

    def __init__(
        self, *, batch_sizes: Sequence[int], page_buckets: Sequence[int], query_len: int,
        device: torch.device,
    ) -> None:
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.page_buckets = tuple(sorted(set(page_buckets)))
        self.query_len = query_len
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if on_cuda else None
        self.ring: PinnedRing | HostRing = (
            PinnedRing(self.device, torch.int64, depth=8) if on_cuda else HostRing())
        self.graphs: dict[tuple[int, int], DraftGraph] = {}
        #: proposes served by a graph (replays on CUDA, eager static forwards on CPU).
        self.runs = 0

    def lookup(self, bsz: int, need_pages: int) -> DraftGraph | None:
        """The bucket's graph (buffers created on first use, not captured yet), or None when
        ``bsz`` or ``need_pages`` is above the largest bucket."""
        bb = pick_bucket(bsz, self.batch_sizes)
        pp = pick_bucket(need_pages, self.page_buckets)
        if bb is None or pp is None:
            return None
        g = self.graphs.get((bb, pp))
        if g is None:
            g = self.graphs[(bb, pp)] = DraftGraph(bb, pp, self.query_len, self.device)
        return g

    def run(self, g: DraftGraph, drafter: GraphDrafter) -> None:
        """Compute ``g``'s outputs from its staged inputs: capture if needed, then replay (on
        the current stream, after the staging copy). On CPU: the eager static forward."""
        if self.pool is None:
            g.root_logp, g.tree = g.forward(drafter)
        else:
            if not g.captured:
                g.capture(drafter, self.pool, drafter.graph_keeps_root_logp)
            g.replay()
        self.runs += 1

    def propose(
        self, g: DraftGraph, drafter: GraphDrafter, reqs: Sequence[DraftRequest],
        plan: ProposePlan,
    ) -> VerifyTree:
        """Draft ``reqs`` through ``g`` (``len(reqs) <= g.bsz``, every active request's pages
        within ``g.pages``). Returns views of ``g``'s static output rows ``[:len(reqs)]``.

        Stream order (all on the current stream): eager prefixes of long catch-ups, then the
        one H2D copy of the staged ints, then the replay, which reads both.
        """
        q = g.query_len
        bsz = len(reqs)
        starts = [max(s, e - q) for s, e in zip(plan.starts, plan.ends, strict=True)]
        long_rows = [j for j, (s, s0) in enumerate(zip(starts, plan.starts, strict=True))
                     if s > s0]
        if long_rows:  # rare: first sight of a prompt; prefill-like, eager
            act = [reqs[i] for i in plan.active]
            drafter.write_prefix([act[j] for j in long_rows],
                                 [plan.starts[j] for j in long_rows],
                                 [starts[j] for j in long_rows])
        buf = self.ring.acquire(g.ints.numel())
        stage_propose_inputs(buf.numpy(), g, drafter, reqs, plan, starts)
        self.ring.copy_to(buf, g.ints)  # one async H2D copy, stream-ordered before the replay
        self.run(g, drafter)
        assert g.tree is not None
        t = g.tree
        drafter.last_root_logp = g.root_logp[:bsz] if g.root_logp is not None else None
        return VerifyTree(draft_tokens=t.draft_tokens[:bsz], parents=t.parents[:bsz],
                          depth=t.depth[:bsz], next_token=t.next_token[:bsz],
                          next_sibling=t.next_sibling[:bsz],
                          ancestor_mask=t.ancestor_mask[:bsz],
                          host_links=t.host_links)  # all B rows: [:, :bsz] are this batch's

    def warmup(
        self, drafter: GraphDrafter, min_pages: int, *, batch_sizes: Sequence[int] | None = None,
        pages: Sequence[int] | None = None,
    ) -> int:
        """Capture graphs ahead of time (largest first) with dummy rows only (their writes go
        to the sink page). No-op off CUDA.

        Args:
            min_pages: the narrowest page table an all-dummy batch may use (dummy rows write
                positions ``0 .. scratch``).
            batch_sizes: batch sizes to capture the buckets of (default: all).
            pages: page-table widths to capture the buckets of (default: all).

        Returns:
            The number of graphs captured by this call.
        """
        if self.pool is None:
            return 0
        bss = batch_sizes if batch_sizes is not None else self.batch_sizes
        pps = pages if pages is not None else self.page_buckets
        count = 0
        for bs in sorted(set(bss), reverse=True):
            for pp in sorted(set(pps), reverse=True):
                g = self.lookup(bs, max(pp, min_pages))
                if g is None or g.captured:
                    continue
                g.reset_dummy()
                g.capture(drafter, self.pool, drafter.graph_keeps_root_logp)
                count += 1
        return count
