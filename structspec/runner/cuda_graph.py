"""CUDA graph capture and replay of the tree-verify forward (plain decode = verify with N=1).

One graph per bucket ``(B, N, P, aux)``: ``B`` a batch-size bucket (the batch is padded with
dummy rows), ``N`` the tree size, ``P`` a page-table width whose ``kv_len = P * page_size`` is a
KV-length bucket (powers of two from 256, then ``max_model_len``), ``aux`` the aux hidden
layers. Graphs are captured lazily on first use (or eagerly, :meth:`ModelRunner.warmup_cuda_graphs`)
and share one memory pool; shapes above the largest bucket run eagerly.

Static inputs (device, per graph): ``seq_lens [B]``, ``page_table [B, P]``,
``draft_tokens [B, N]``, ``depth [B, N]``, ``parents [B, N]`` (one flat int64 buffer, so one
H2D copy fills the host-made part) and ``ancestor_mask [B, N, N]`` bool. The ForwardBatch
(slots, positions, mask) is built *inside* the graph from them by
:func:`~structspec.runner.batch_builder.build_verify_batch_from_tensors`.

Post graphs: for greedy batches everything after the forward is a second, small graph per
bucket (and per variant ``(masked, penalised)``): the scheduler's select/verify function
(:class:`SelectVerify`: the sampling penalties of each row's tree path when a request of the
batch has some, reading the penalty table and a static ``[B]`` int64 slot input; apply the
grammar bitmask, a static ``[B*N, W]`` int32 input shared by the buckets of one ``(B, N)``;
argmax; tree verification; the count of real drafts and of the penalised runs), then the
accepted-path KV compaction. The penalised variants are captured at their first use, or by
:meth:`ModelRunner.warmup_cuda_graphs` given the penalty table; batches without penalties
never run them. The runner knows neither the grammar nor the drafters: the scheduler hands
it that function and the bitmask width (:meth:`ModelRunner.set_select_verify`), so the graph
records the very function the eager path calls. Run eagerly these are ~60 small kernels
whose launches cost ~1 ms of host time per step on an H200 host (more than SmolLM2's whole
verify forward); replayed they are one launch. The post graph is separate from the forward
graph because the bitmask is built on the host *while the forward runs* and is uploaded just
before the post work.

Dummy rows: ``seq_len 0`` and a page-table row of page 0 (the sink), so they write their
K/V only into page 0 and attend only their own node (ancestor mask: at least the diagonal);
real rows never attend page 0, so nothing leaks into real outputs.

Static outputs (graph pool): ``logits [B*N, V]`` float32, ``hidden [B, N, H]`` and the aux
layer outputs ``[B, N, H]`` in the model dtype. They are overwritten by the next replay of any
graph sharing the pool, so a verify output is valid until the next ``verify()`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
from torch import nn

from structspec.draft_tree.verify import VerifyResult
from structspec.kvcache.pool import KVPool
from structspec.layers.penalties import PenaltyInputs, PenaltyTable
from structspec.runner.batch_builder import build_verify_batch_from_tensors, compact_accepted_kv
from structspec.staging import before_host_sync, side_upload_target

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIN_KV_BUCKET = 256
#: batch-bucket spacing above the last of :data:`DEFAULT_BATCH_SIZES` (see
#: :func:`graph_batch_sizes`)
LARGE_BATCH_STEP = 32


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch-size buckets of an engine serving up to ``max_batch_size`` requests.

    :data:`DEFAULT_BATCH_SIZES`, and above its last bucket (64) one every
    :data:`LARGE_BATCH_STEP` up to ``max_batch_size``, the last being ``max_batch_size``
    itself. Without the larger buckets every verify of more than 64 requests ran eagerly (no
    CUDA graph, the post-forward work kernel by kernel): hundreds of kernel launches of host
    time per step, at exactly the batch sizes an offline run uses. A batch pads to its bucket
    with dummy rows (fewer than ``LARGE_BATCH_STEP``); graphs are captured on first use.
    """
    out = list(DEFAULT_BATCH_SIZES)
    b = out[-1] + LARGE_BATCH_STEP
    while b < max_batch_size:
        out.append(b)
        b += LARGE_BATCH_STEP
    if max_batch_size > out[-1]:
        out.append(max_batch_size)
    return tuple(out)


def kv_len_buckets(max_model_len: int, *, min_len: int = MIN_KV_BUCKET) -> tuple[int, ...]:
    """KV-length buckets: powers of two from ``min_len`` below ``max_model_len``, then
    ``max_model_len`` itself."""
    out: list[int] = []
    length = min_len
    while length < max_model_len:
        out.append(length)
        length *= 2
    out.append(max_model_len)
    return tuple(out)


def pick_bucket(value: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket ``>= value`` (``buckets`` ascending), None if ``value`` is above all."""
    for b in buckets:
        if b >= value:
            return b
    return None


GraphKey = tuple[int, int, int, tuple[int, ...]]

T = TypeVar("T")


def capture_after_warmup(forward: Callable[[], T], pool: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``forward`` once eagerly on a side stream (it JIT-compiles its kernels and sizes
    the allocator pool), then capture it into ``pool``. Syncs the device (only here, never in
    a replay). ``forward`` runs twice, so it must write only what its replay writes again
    (the same K/V from the same staged inputs). The side stream waits for the current one
    first: the staged inputs (and any eager work before) come before the warm-up.

    Returns:
        The graph and the captured call's outputs (the graph's static output tensors).
    """
    before_host_sync()  # the capture syncs the device: a gated upload's flags first
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=cur.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        forward()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


class SelectVerify(Protocol):
    """Target selection and tree verification after a verify forward, as the scheduler
    composes it (:func:`structspec.scheduler.select_verify.select_verify`).

    Called with ``(logits [R, V] float32, bitmask [R, W] int32 or None, draft_tokens,
    parents, depth [B, N] int64, ancestor_mask [B, N, N] bool, max_accept_drafts [B] int64
    or None, penalties (the penalty table and [B] int64 slots) or None)``, all on one
    device, ``R = B * N``: penalises and masks ``logits`` in place, picks each row's argmax,
    verifies the trees and counts the committed runs into the penalty slots. Returns
    ``(VerifyResult [B, N] / [B], num_real [B] int64 real drafts per request)``. No host
    sync: a CUDA graph records it.
    """

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor | None,
                 draft_tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                 ancestor_mask: torch.Tensor, max_accept_drafts: torch.Tensor | None,
                 penalties: PenaltyInputs | None, /) -> tuple[VerifyResult, torch.Tensor]: ...


PostKey = tuple[bool, bool]
"""A post graph's variant: ``(masked, penalised)``."""


class VerifyGraph:
    """Static buffers, and once captured the graph, of one ``(B, N, P, aux)`` bucket.

    Attributes:
        bsz, num_nodes, pages: the bucket's ``B``, ``N``, ``P``.
        ints: ``[B * (1 + P + 3N)]`` int64 device buffer: ``seq_lens | page_table |
            draft_tokens | depth | parents``, row-major (the views below).
        seq_lens: ``[B]`` int64 view.  page_table: ``[B, P]`` int64 view.
        draft_tokens, depth, parents: ``[B, N]`` int64 views (``parents`` is read only by
            the post graph).
        ancestor_mask: ``[B, N, N]`` bool device buffer (initially the identity per row).
        logits: ``[B * N, V]`` float32 static output (after capture).
        hidden: ``[B, N, H]`` static output.  aux: list of ``[B, N, H]`` static outputs.
        bitmask: ``[B * N, W]`` int32 post-graph input (shared per ``(B, N)``; set by
            :meth:`VerifyGraphCache.post_inputs`).  cap: ``[B]`` int64 accepted-draft cap.
        post_graphs: the post graphs by variant ``(masked, penalised)``.
        post_out: per variant, the post graph's static ``(VerifyResult [B, N], num_real
            [B])``.
        penalty_table: the penalty table the penalised post graphs read (they are
            recaptured if another one is passed).
    """

    def __init__(
        self, bsz: int, num_nodes: int, pages: int, aux_layers: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.bsz, self.num_nodes, self.pages = bsz, num_nodes, pages
        self.aux_layers = aux_layers
        n = num_nodes
        self.ints = torch.zeros(bsz * (1 + pages + 3 * n), dtype=torch.int64, device=device)
        self.seq_lens = self.ints[:bsz]
        o = bsz
        self.page_table = self.ints[o : o + bsz * pages].view(bsz, pages)
        o += bsz * pages
        self.draft_tokens = self.ints[o : o + bsz * n].view(bsz, n)
        o += bsz * n
        self.depth = self.ints[o : o + bsz * n].view(bsz, n)
        o += bsz * n
        self.parents = self.ints[o : o + bsz * n].view(bsz, n)
        self.ancestor_mask = (
            torch.eye(n, dtype=torch.bool, device=device).expand(bsz, n, n).contiguous()
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.aux: list[torch.Tensor] = []
        self.bitmask: torch.Tensor | None = None
        self.cap: torch.Tensor | None = None
        self.post_graphs: dict[PostKey, torch.cuda.CUDAGraph] = {}
        self.post_out: dict[PostKey, tuple[VerifyResult, torch.Tensor]] = {}
        self.penalty_table: PenaltyTable | None = None

    @property
    def host_ints(self) -> int:
        """Elements of ``ints`` the host fills every step (``seq_lens | page_table``)."""
        return self.bsz * (1 + self.pages)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def reset_dummy(self) -> None:
        """Make every row a dummy row (device ops only; used before an eager warm-up capture)."""
        self.ints.zero_()
        eye = torch.eye(self.num_nodes, dtype=torch.bool, device=self.ints.device)
        self.ancestor_mask.copy_(eye.expand_as(self.ancestor_mask))

    def forward(
        self, model: nn.Module, kv_pool: KVPool, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The verify forward on the static inputs, run eagerly (what the graph records).

        Returns:
            ``(logits [B*N, V] float32, hidden [B, N, H], aux [B, N, H] each)``, fresh tensors.
        """
        fb = build_verify_batch_from_tensors(
            self.draft_tokens, self.depth, self.ancestor_mask, self.seq_lens, self.page_table,
            page_size=page_size,
        )
        out = model(fb, kv_pool, aux_hidden_layers=self.aux_layers)
        hidden = out.hidden_states
        logits = model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return logits, hidden, list(out.aux_hidden_states)

    def capture(self, model: nn.Module, kv_pool: KVPool, page_size: int, pool: tuple) -> None:
        """Warm up once on a side stream, then capture into ``pool``. Syncs the device (only
        here, never in replay). The warm-up writes the same K/V the replay will write."""
        self.graph, (self.logits, self.hidden, self.aux) = capture_after_warmup(
            lambda: self.forward(model, kv_pool, page_size), pool)

    def replay(self) -> None:
        """Launch the graph on the current stream (no host sync)."""
        assert self.graph is not None, "capture() first"
        self.graph.replay()

    def post_forward(
        self, kv_pool: KVPool, page_size: int, masked: bool, select_verify: SelectVerify,
        penalties: PenaltyInputs | None = None,
    ) -> tuple[VerifyResult, torch.Tensor]:
        """Greedy post-forward work on the static buffers, run eagerly (what the post graph
        records): ``select_verify`` (penalise the logits in place with ``penalties``, whose
        slots are a static input with slot 0 on the dummy rows; mask them, with ``bitmask``
        and ``cap`` when ``masked``; argmax each row; verify every tree; count the real
        drafts and the penalised runs), then compact the accepted paths' KV (dummy rows move
        sink slots only).

        Returns:
            ``(VerifyResult with [B, N] / [B] tensors, num_real [B] int64)``, fresh tensors.
        """
        assert self.logits is not None, "capture() the forward first"
        bitmask = cap = None
        if masked:
            assert self.bitmask is not None and self.cap is not None
            bitmask, cap = self.bitmask, self.cap
        result, num_real = select_verify(self.logits, bitmask, self.draft_tokens, self.parents,
                                         self.depth, self.ancestor_mask, cap, penalties)
        compact_accepted_kv(kv_pool, result.accept_nodes, self.seq_lens, self.page_table,
                            page_size=page_size)
        return result, num_real

    def run_post(
        self, kv_pool: KVPool, page_size: int, masked: bool, pool: tuple,
        select_verify: SelectVerify, penalties: PenaltyInputs | None = None,
    ) -> tuple[VerifyResult, torch.Tensor]:
        """Replay the post graph of variant ``(masked, penalties is not None)`` (capturing it
        on first use); returns its ``[B, ...]`` outputs.

        First use runs :meth:`post_forward` eagerly for real (its results are this step's)
        and then records the graph *without* replaying it: a replay after an eager run would
        compact the KV a second time, reading slots the first pass already overwrote. The
        eager run also does the lazy work (Triton compiles) before the capture. Capture syncs
        the device (only here, never in replay).
        """
        key = (masked, penalties is not None)
        if penalties is not None and penalties.table is not self.penalty_table:
            # the penalised graphs read the table's tensors: a new table needs new graphs
            for k in [k for k in self.post_graphs if k[1]]:
                del self.post_graphs[k], self.post_out[k]
            self.penalty_table = penalties.table
        graph = self.post_graphs.get(key)
        if graph is not None:
            graph.replay()
            return self.post_out[key]
        # the capture below syncs the device: a gated bitmask upload's flags must be released
        # first (staging.register_before_host_sync)
        before_host_sync()
        out = self.post_forward(kv_pool, page_size, masked, select_verify, penalties)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.post_out[key] = self.post_forward(kv_pool, page_size, masked, select_verify,
                                                   penalties)
        self.post_graphs[key] = graph
        return out


class VerifyGraphCache:
    """The runner's verify graphs: bucket lookup, lazy capture, one shared memory pool.

    Args:
        model: the target model (on ``device``).
        kv_pool: the target KV pool (its tensors are baked into the graphs).
        page_size: tokens per KV page.
        max_model_len: longest sequence; the largest KV bucket.
        batch_sizes: batch-size buckets (ascending after sorting).
        device: a CUDA device.
    """

    def __init__(
        self, model: nn.Module, kv_pool: KVPool, *, page_size: int, max_model_len: int,
        batch_sizes: Sequence[int], device: torch.device,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.device = device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.page_buckets = tuple(
            sorted({-(-length // page_size) for length in kv_len_buckets(max_model_len)})
        )
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, VerifyGraph] = {}
        self._post_inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._penalty_slots: dict[tuple[int, int], torch.Tensor] = {}
        self._cap_dirty: set[tuple[int, int]] = set()  # caps holding real values
        #: the post graphs' function and the bitmask width (int32 words per row), both from
        #: the scheduler (:meth:`ModelRunner.set_select_verify`); None = no post graphs yet
        self.select_verify: SelectVerify | None = None
        self.bitmask_width: int | None = None

    def lookup(
        self, bsz: int, num_nodes: int, need_pages: int, aux_layers: tuple[int, ...]
    ) -> VerifyGraph | None:
        """The bucket's graph (static buffers created on first use, not yet captured), or
        None when ``bsz`` or ``need_pages`` is above the largest bucket."""
        bb = pick_bucket(bsz, self.batch_sizes)
        pp = pick_bucket(need_pages, self.page_buckets)
        if bb is None or pp is None:
            return None
        key = (bb, num_nodes, pp, aux_layers)
        g = self.graphs.get(key)
        if g is None:
            g = VerifyGraph(bb, num_nodes, pp, aux_layers, self.device)
            self.graphs[key] = g
        return g

    def ensure_captured(self, g: VerifyGraph) -> None:
        """Capture ``g`` (its static inputs already staged) if it is not captured yet."""
        if not g.captured:
            g.capture(self.model, self.kv_pool, self.page_size, self.pool)

    def post_inputs(self, g: VerifyGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """``g``'s post-graph inputs ``(bitmask [B*N, W] int32, cap [B] int64)``, created on
        first use and shared by every bucket of the same ``(B, N)`` (only one graph runs at a
        time). A fresh bitmask allows everything; a fresh cap is ``N`` (no cap)."""
        assert g.logits is not None, "capture the forward first"
        assert self.bitmask_width is not None, "ModelRunner.set_select_verify() first"
        key = (g.bsz, g.num_nodes)
        if key not in self._post_inputs:
            # the bitmask is uploaded on the copy stream (staging.upload_pinned_side): made
            # there, so its fill cannot land after an upload (it would, queued behind a
            # forward already launched on this stream)
            self._post_inputs[key] = (
                side_upload_target((g.bsz * g.num_nodes, self.bitmask_width), -1, torch.int32,
                                   self.device),
                torch.full((g.bsz,), g.num_nodes, dtype=torch.int64, device=self.device),
            )
        g.bitmask, g.cap = self._post_inputs[key]
        return g.bitmask, g.cap

    def penalty_slots(self, g: VerifyGraph) -> torch.Tensor:
        """``g``'s post-graph penalty-slot input, ``[B]`` int64 (0: no penalties), created on
        first use and shared by every bucket of the same ``(B, N)``."""
        key = (g.bsz, g.num_nodes)
        if key not in self._penalty_slots:
            self._penalty_slots[key] = torch.zeros(g.bsz, dtype=torch.int64,
                                                   device=self.device)
        return self._penalty_slots[key]

    def run_post(
        self, g: VerifyGraph, masked: bool, staged_cap: Callable[[torch.Tensor], None] | None,
        penalties: tuple[PenaltyTable, Callable[[torch.Tensor], None]] | None = None,
    ) -> tuple[VerifyResult, torch.Tensor]:
        """:meth:`VerifyGraph.run_post` with this cache's pools.

        Args:
            g: a captured bucket whose forward was just replayed.
            masked: apply the bitmask (already uploaded into :meth:`post_inputs`).
            staged_cap: when a grammar walk timed out, a function that queues the real
                ``[bsz]`` caps into the given ``cap[:bsz]`` view (non_blocking H2D); None = no
                cap this step (the buffer is reset to ``N`` if a previous step wrote caps).
            penalties: for a batch with a penalised request, the penalty table and a function
                that queues the ``[B_bucket]`` slots (0 on the dummy rows) into the given
                static slot input (non_blocking H2D); None = the unpenalised post graph.
        """
        assert self.select_verify is not None, "ModelRunner.set_select_verify() first"
        inputs = None
        if penalties is not None:
            table, stage_slots = penalties
            slots = self.penalty_slots(g)
            stage_slots(slots)
            inputs = PenaltyInputs(table, slots)
        if masked:
            _, cap = self.post_inputs(g)
            key = (g.bsz, g.num_nodes)
            if staged_cap is not None:
                staged_cap(cap)
                self._cap_dirty.add(key)
            elif key in self._cap_dirty:
                cap.fill_(g.num_nodes)
                self._cap_dirty.discard(key)
        return g.run_post(self.kv_pool, self.page_size, masked, self.pool, self.select_verify,
                          inputs)
