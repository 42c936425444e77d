"""The grammar mask over a verify tree: host staging of the tree and the parallel mask build.

Per speculative step (docs/architecture.md, the step timeline):

1. ``GrammarTree.from_device(...)`` *before* the verify launch: the device->host copies of the
   tree are queued on the current stream right behind the drafter's kernels, and an event is
   recorded after them (:class:`~structspec.staging.DeviceToHost`). Nothing waits yet.
2. The verify forward is launched (asynchronous).
3. ``build_grammar_vocab_mask(...)`` *after* the launch, while the GPU runs: the barrier
   advances the matchers over the previous step's committed runs, ``tree.resolve()`` waits on
   the event (the copies finished long ago, behind the draft, so this is short), the bitmask is
   built on the host (xgrammar ``traverse_draft_tree``: accept, fill row, recurse, roll back),
   and a pinned -> device asynchronous copy is queued: into a CUDA graph's static bitmask on
   the copy stream (:func:`~structspec.staging.upload_pinned_side`), so it runs beside the
   forward and the post graph's stream waits on its event; otherwise on the current stream
   (:func:`~structspec.staging.upload_pinned`), where stream order puts it before the mask is
   applied to the verify logits.

Source of the design: sglang ``spec_utils.py`` (``GrammarTree``, ``build_grammar_vocab_mask``,
``traverse_tree``): the tree is staged for the host before the verify launch and its bitmask
is built while the verify forward runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from structspec.draft_tree.layout import parents_from_links
from structspec.grammar.bitmask import allocate_bitmask
from structspec.grammar.deferred_build import DeferredPoolBuild
from structspec.grammar.pool_types import PoolBuildResult, PoolRequest
from structspec.grammar.worker_pool import MaskWorkerPool
from structspec.staging import (
    DeviceToHost,
    PendingCopy,
    StreamWaitError,
    register_before_host_sync,
    upload_pinned,
    upload_pinned_gated,
    upload_pinned_side,
    wait_upload,
)

if TYPE_CHECKING:  # the mask worker processes import this module: no llguidance import there
    from structspec.grammar.matchers import AnyMatcher

logger = logging.getLogger(__name__)


@dataclass
class GrammarTree:
    """Host view of the verify trees of a batch (node 0 of each row = last committed token).

    Attributes:
        next_token_cpu: ``int64 [bs, N]`` first child of each node, -1 = none.
        next_sibling_cpu: ``int64 [bs, N]`` next sibling of each node, -1 = none.
        draft_tokens_cpu: ``int64 [bs, N]`` token id at each node (-1 = padding node).
        parents_cpu: ``int64 [bs, N]`` parent of each node (-1 for the root), or None: then
            :meth:`resolve` derives it from the links (a host walk; drafters pass it).
        copy: the D2H copies of a device tree (their event), or None for host trees.
    """

    next_token_cpu: torch.Tensor
    next_sibling_cpu: torch.Tensor
    draft_tokens_cpu: torch.Tensor
    parents_cpu: torch.Tensor | None = None
    copy: PendingCopy | None = None

    @classmethod
    def from_device(cls, next_token: torch.Tensor, next_sibling: torch.Tensor,
                    draft_tokens: torch.Tensor,
                    parents: torch.Tensor | None = None) -> GrammarTree:
        """Stage a device tree for the host. Call it *before* launching the verify forward.

        Args:
            next_token, next_sibling, draft_tokens: ``int64`` (or int32) ``[bs, N]`` on one
                device (``draft_tokens`` may be flat ``[bs * N]``; it is reshaped).
            parents: ``[bs, N]`` parent indices on the same device (optional; saves a host
                walk in :meth:`resolve`).

        On CUDA: the tensors are stacked on the device and copied asynchronously, as one
        copy, into fresh pinned int64 host memory, the sources protected by ``record_stream``,
        and one event is recorded after the copy
        (:meth:`~structspec.staging.DeviceToHost.launch_packed`), so :meth:`resolve` later
        waits only for it (not for the verify forward queued after). On the CPU: int64 host
        tensors, no event.
        """
        bs, n = next_token.shape
        draft_tokens = draft_tokens.reshape(bs, n)
        if next_token.device.type != "cuda":
            return cls.from_host(next_token, next_sibling, draft_tokens, parents)
        srcs = [next_token, next_sibling, draft_tokens] + ([] if parents is None else [parents])
        # A DeviceToHost per tree: fresh pinned buffers per step, as the tree has always had
        # (a steady-state pinned allocation is a caching-host-allocator lookup).
        copy = DeviceToHost(record_stream=True).launch_packed(srcs, dtype=torch.int64)
        hosts = copy.hosts
        return cls(hosts[0], hosts[1], hosts[2], hosts[3] if parents is not None else None,
                   copy=copy)

    @classmethod
    def from_links(cls, links: torch.Tensor, batch_size: int) -> GrammarTree:
        """Stage a device tree whose links are packed already
        (:attr:`~structspec.draft_tree.layout.VerifyTree.host_links`): one contiguous D2H copy
        into fresh pinned memory and one event, nothing else launched. Call it *before*
        launching the verify forward, as :meth:`from_device`.

        Args:
            links: ``int64 [4, B', N]`` contiguous on one device, ``B' >= batch_size``: rows
                ``next_token``, ``next_sibling``, ``draft_tokens``, ``parents``.
            batch_size: the batch's ``B`` (the host fields are rows ``[:B]``).

        Raises:
            ValueError: ``links`` is not a contiguous int64 ``[4, B', N]`` with
                ``B' >= batch_size``, or ``batch_size`` is not an integer >= 0.
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            raise ValueError(f"batch_size must be an integer >= 0, got {batch_size!r}")
        if (links.dim() != 3 or links.shape[0] != 4 or links.shape[1] < batch_size
                or links.dtype != torch.int64 or not links.is_contiguous()):
            raise ValueError(f"links must be a contiguous int64 [4, B' >= {batch_size}, N] "
                             f"tensor, got {links.dtype} {tuple(links.shape)}")
        if links.device.type != "cuda":
            host = links[:, :batch_size]
            return cls.from_host(host[0], host[1], host[2], host[3])
        # Static graph memory (or, eagerly, a tensor made on this stream): no record_stream
        copy = DeviceToHost().launch([links])
        host = copy.hosts[0]
        return cls(host[0, :batch_size], host[1, :batch_size], host[2, :batch_size],
                   host[3, :batch_size], copy=copy)

    @classmethod
    def from_host(cls, next_token: torch.Tensor, next_sibling: torch.Tensor,
                  draft_tokens: torch.Tensor,
                  parents: torch.Tensor | None = None) -> GrammarTree:
        """Wrap a host-built tree (e.g. n-gram drafts): no copy, no event.

        Args:
            next_token, next_sibling, draft_tokens: CPU integer tensors ``[bs, N]``.
            parents: optional CPU ``[bs, N]`` parent indices.
        """
        bs, n = next_token.shape
        return cls(next_token.to(torch.int64), next_sibling.to(torch.int64),
                   draft_tokens.reshape(bs, n).to(torch.int64),
                   None if parents is None else parents.to(torch.int64))

    @classmethod
    def from_linear_chain(cls, ids: torch.Tensor) -> GrammarTree:
        """A chain per request: node ``j``'s only child is ``j + 1``.

        Args:
            ids: ``int64 [bs, L]``, column 0 = last committed token (CPU or CUDA; a CUDA
                tensor is staged asynchronously like :meth:`from_device`).
        """
        bs, length = ids.shape
        nxt = torch.arange(1, length + 1, dtype=torch.int64, device=ids.device)
        nxt[-1] = -1
        next_token = nxt.expand(bs, length).contiguous()
        next_sibling = torch.full((bs, length), -1, dtype=torch.int64, device=ids.device)
        parents = (torch.arange(length, dtype=torch.int64, device=ids.device) - 1).expand(
            bs, length).contiguous()
        return cls.from_device(next_token, next_sibling, ids, parents)

    @property
    def shape(self) -> tuple[int, int]:
        """``(bs, N)``."""
        bs, n = self.next_token_cpu.shape
        return bs, n

    def arrived(self) -> bool:
        """Whether :meth:`resolve` would return without waiting (a host tree, or a device
        tree whose copies have landed); never blocks."""
        return self.copy is None or self.copy.done()

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wait for the staged copies (once) and return the three host tensors.

        Call it *after* the verify launch: the event was recorded before the launch, so this
        waits only for the small tree copies, never for the verify forward. Idempotent.
        """
        if self.copy is not None:
            self.copy.wait()
        return self.next_token_cpu, self.next_sibling_cpu, self.draft_tokens_cpu

    def parents(self) -> torch.Tensor:
        """``int64 [bs, N]`` host parent indices (after :meth:`resolve`); derived from the
        first-child / next-sibling links when the tree was staged without them."""
        self.resolve()
        if self.parents_cpu is None:
            self.parents_cpu = parents_from_links(self.next_token_cpu, self.next_sibling_cpu)
        return self.parents_cpu


@dataclass
class GrammarMaskResult:
    """The tree bitmask of one verify step.

    Attributes:
        bitmask_device: ``int32 [bs * N, W]`` on the verify device (row ``i * N + j`` =
            allowed tokens after the path to node ``j`` of request ``i``); the H2D copy is
            queued asynchronously on the current stream
            (:func:`~structspec.staging.upload_pinned`), or on the copy stream when it goes
            into a CUDA graph's static bitmask (then see ``upload_done``).
        bitmask_cpu: the pinned host source (a fresh buffer per step, or the worker pool's
            slab, reused only after the next wait; so no overwrite hazard).
        max_accept_cpu: ``int32 [bs]`` the most draft tokens the verifier may accept per
            request: ``N - 1`` normally, ``0`` for a request whose traversal timed out (its row
            0 is exact, every other row unconstrained: only the bonus token may be taken).
        truncated_requests: batch indices whose traversal timed out.
        rejected_by_grammar: per request, reached draft nodes whose token the parent's row
            forbids (for the "drafts rejected by the grammar" metric); 0 without a matcher.
        build_s: host seconds spent in barrier + resolve + build (for metrics).
        mirror: the worker pool's result (its mirrors' verdicts on the new ids) when the
            pool built the mask; None for the in-process build.
        upload_done: the copy stream's event after the upload
            (:func:`~structspec.staging.upload_pinned_side`): the stream that reads
            ``bitmask_device`` waits on it first (:meth:`wait_upload`); None when the copy
            was queued on the current stream, or once waited for.
        caps_pinned: a deferred build's ``int64 [bs]`` caps in the workers' page-locked
            segment (:mod:`~structspec.grammar.deferred_build`): the device reads them, and
            the bitmask, only once the workers stored their flags, so the caps are copied
            from here on every step (``truncated_requests`` is known only after
            :meth:`complete`). None otherwise.
        pending: a deferred build's completion (:meth:`complete`), or None.
        gate: the deferred build itself (its rows, caps and flags), or None.
        unregister: undoes the registration of :meth:`complete` to run before a host sync
            (:func:`~structspec.staging.register_before_host_sync`), or None.
    """

    bitmask_device: torch.Tensor
    bitmask_cpu: torch.Tensor
    max_accept_cpu: torch.Tensor
    truncated_requests: list[int]
    rejected_by_grammar: list[int]
    build_s: float = 0.0
    mirror: PoolBuildResult | None = None
    upload_done: torch.cuda.Event | None = None
    caps_pinned: torch.Tensor | None = None
    pending: Callable[[], None] | None = None
    gate: DeferredPoolBuild | None = None
    unregister: Callable[[], None] | None = None

    def complete(self) -> None:
        """Finish a deferred build: read the workers' replies and fill ``truncated_requests``,
        ``rejected_by_grammar`` and ``mirror``. Once; a no-op for other builds.

        Raises:
            MaskPoolError: a worker died or failed (the caller's fail-over writes the rows
                and releases the flags the device waits on).
        """
        pending, self.pending = self.pending, None
        if pending is not None:
            if self.unregister is not None:
                self.unregister()
            pending()

    def wait_upload(self) -> None:
        """Make the current stream wait (on the device) for a copy-stream upload of the bitmask;
        once: later calls, and a current-stream upload, do nothing."""
        wait_upload(self.upload_done)
        self.upload_done = None


def build_grammar_vocab_mask(
    matchers: Sequence[AnyMatcher | None],
    tree: GrammarTree,
    *,
    vocab_size: int,
    device: torch.device | str,
    barrier: Callable[[], None] | None = None,
    time_limit_s: float = 0.05,
    executor: ThreadPoolExecutor | None = None,
    num_workers: int = 1,
    out: torch.Tensor | None = None,
) -> GrammarMaskResult | None:
    """Build the grammar bitmask for every node of every request's verify tree.

    Order: ``barrier()`` first (it advances the matchers over the previous step's committed
    runs: the traversal must start from that state), then ``tree.resolve()``, then one
    ``traverse_draft_tree`` per constrained request, then :func:`settle_tree_rows_batch`
    (vectorised over the batch), then an async H2D copy.

    Parallelism: with ``executor`` and ``num_workers > 1`` the requests are split into
    ``num_workers`` contiguous chunks, one task each. xgrammar releases the GIL inside
    ``traverse_draft_tree`` (measured: a Python loop keeps ~90% of its speed while another
    thread walks trees), so chunks walk in parallel; one task per chunk (not per request)
    keeps the GIL hand-offs per step at ``num_workers`` instead of ``bs``.

    Each row is the mask of the state after that node's path. A node whose token its parent's
    row forbids is never reached: its row and its subtree's rows are all ones, which is
    harmless because the verifier can never accept it (the masked parent cannot produce it). A
    node that terminates the grammar (stop token) gets an all-ones row too; the result
    processor cuts the run there. A terminated or absent matcher leaves its rows all ones.

    Timeout fallback: when one request's traversal exceeds ``time_limit_s``, its rows are reset,
    row 0 is filled from the root state (exact), and ``max_accept_cpu[i] = 0``: the verifier
    must accept no draft for it, so only the bonus token from the exact row 0 is emitted.

    Args:
        matchers: one per request in batch order (None = unconstrained request).
        tree: the staged tree (see :class:`GrammarTree`).
        vocab_size: the logits width (bitmask width ``ceil(vocab_size / 32)``).
        device: where the verify logits live.
        barrier: advances pending matchers (the scheduler's grammar barrier), or None.
        time_limit_s: per-request traversal limit (xgrammar ``time_threshold``).
        executor: a thread pool for the chunks; None = serially on this thread.
        num_workers: how many chunks to split the batch into (used only with ``executor``).
        out: a device ``int32 [>= bs * N, W]`` buffer to upload into (rows ``[:bs * N]``; a
            CUDA graph's static bitmask input); None = a fresh device tensor.

    Returns:
        A :class:`GrammarMaskResult`, or None when no request has a matcher.

    Raises:
        ValueError: when ``len(matchers)`` differs from the tree's batch size.
    """
    t0 = time.perf_counter()
    if barrier is not None:
        barrier()
    if all(m is None for m in matchers):
        return None
    next_token, next_sibling, draft_tokens = tree.resolve()
    bs, n = next_token.shape
    if len(matchers) != bs:
        raise ValueError(f"{len(matchers)} matchers for a tree batch of {bs}")
    # page-locked for an asynchronous upload; a build for the host (a deferred build's
    # rebuild, which must not allocate page-locked memory while the device waits) stays pageable
    bitmask = allocate_bitmask(bs * n, vocab_size, pin=torch.device(device).type != "cpu")
    active = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    timed_out: list[int] = []

    # Per-request views made in four C++ calls instead of four Python indexings per request,
    # when most rows are walked; when few are (a batch mostly unconstrained), views of the
    # walked rows only: the four calls make ``4 * bs`` views (~1 ms at batch 256).
    if 2 * len(active) >= bs:
        rows_of, nt_of, ns_of, dt_of = (bitmask.split(n), next_token.unbind(0),
                                        next_sibling.unbind(0), draft_tokens.unbind(0))
    else:
        rows_of, nt_of, ns_of, dt_of = ({i: t[i] for i in active} for t in (
            bitmask.view(bs, n, -1), next_token, next_sibling, draft_tokens))

    @torch.inference_mode()  # per thread: pool workers need it to write inference tensors
    def walk(chunk: Sequence[int]) -> None:
        for i in chunk:
            m = matchers[i]
            assert m is not None
            if not walk_tree(m, nt_of[i], ns_of[i], dt_of[i], rows_of[i], time_limit_s):
                timed_out.append(i)  # list.append is atomic under the GIL

    workers = min(num_workers, len(active)) if executor is not None else 1
    if workers > 1:
        size = -(-len(active) // workers)
        list(executor.map(walk, [active[k:k + size] for k in range(0, len(active), size)]))
    else:
        walk(active)
    return _settle_and_upload(bitmask, matchers, tree, active, timed_out, device=device,
                              out=out, t0=t0)


def walk_tree(matcher: AnyMatcher, next_token: torch.Tensor, next_sibling: torch.Tensor,
              draft_tokens: torch.Tensor, rows: torch.Tensor, time_limit_s: float) -> bool:
    """One request's tree walk into its ``[N, W]`` rows (the matcher's
    ``traverse_draft_tree``: xgrammar's in C++, llguidance's depth-first in Python).

    On a timeout the rows are reset to all ones and row 0 is filled from the state before the
    tree (exact); the caller then caps the request's accepted drafts at 0.

    Returns:
        False when the walk timed out.
    """
    if matcher.traverse_draft_tree(next_token, next_sibling, draft_tokens, rows, time_limit_s):
        return True
    rows.fill_(-1)
    matcher.fill_bitmask(rows, 0)
    return False


def _settle_and_upload(bitmask: torch.Tensor, matchers: Sequence[AnyMatcher | None],
                       tree: GrammarTree, walked: Sequence[int], timed_out: Sequence[int], *,
                       device: torch.device | str, out: torch.Tensor | None,
                       t0: float, settled: dict[int, int] | None = None) -> GrammarMaskResult:
    """The common tail of both builds: settle the walked rows (but ``settled``'s, which the
    mask workers settled, with their counts of grammar-rejected drafts), cap timed-out
    requests, queue the asynchronous upload (into ``out[:bs * N]`` when given)."""
    draft_tokens = tree.draft_tokens_cpu
    bs, n = draft_tokens.shape
    done = settled or {}
    # plain lists and sets: at batch 64 with the workers settling every row, this runs ~64
    # dict items a step, where numpy element writes cost ~3x a list's
    settle = sorted(set(walked).difference(timed_out, done))
    rejected = [0] * bs
    if settle:
        stop_ids = matchers[settle[0]].stop_token_ids  # type: ignore[union-attr]
        rejected = settle_tree_rows_batch(bitmask, draft_tokens, tree.parents(), settle,
                                          stop_token_ids=stop_ids).tolist()
    for b, count in done.items():
        rejected[b] = count
    max_accept = torch.full((bs,), n - 1, dtype=torch.int32)
    if timed_out:
        max_accept[list(timed_out)] = 0
    upload_done = None
    if out is None:
        bitmask_device = upload_pinned(bitmask, device)
    else:
        # a graph's static bitmask: copied beside the verify forward on the copy stream
        bitmask_device = out[: bs * n]
        upload_done = upload_pinned_side(bitmask, bitmask_device)
    return GrammarMaskResult(bitmask_device, bitmask, max_accept, sorted(timed_out),
                             rejected, time.perf_counter() - t0,
                             upload_done=upload_done)


def build_grammar_vocab_mask_pooled(
    pool: MaskWorkerPool,
    requests: Sequence[PoolRequest | None],
    matchers: Sequence[AnyMatcher | None],
    tree: GrammarTree,
    *,
    device: torch.device | str,
    barrier: Callable[[], None] | None = None,
    time_limit_s: float = 0.05,
    out: torch.Tensor | None = None,
    advance_only: Sequence[PoolRequest] = (),
    on_verdicts: Callable[[PoolBuildResult], None] | None = None,
    local: Sequence[int] = (),
    while_drafting: Callable[[Callable[[], bool]], None] | None = None,
    defer: bool = False,
) -> GrammarMaskResult | None:
    """:func:`build_grammar_vocab_mask` with the tree walks in ``pool``'s worker processes.

    The same result, row for row. Order: for a host tree the workers start first and the
    ``barrier`` (the host matchers' advance over the same ids) runs while they walk; for a
    device tree the barrier runs first, while the drafted tree is still on its way to the
    host (:meth:`GrammarTree.resolve` waits for it), then the workers walk, unless the mirrors
    advance the grammar (``on_verdicts`` given): then, as for a host tree, ``barrier`` runs
    after the build is sent and its predicted verdicts are applied. The ``local`` rows
    are walked here, from the host matchers, after the barrier and while the workers walk.
    With mirrors, a device tree and ``while_drafting``, the predicted verdicts are applied
    first and ``while_drafting`` runs while the tree is still on its way (the host would
    otherwise wait for the draft kernels there), then the build is sent.

    Args:
        pool: the worker pool (its slab holds the rows; on CUDA it is page-locked).
        requests: per batch row, what the pool needs (None = unconstrained, or ``local``).
        matchers: the host matchers in batch order (after the barrier they hold the same
            states as the workers' mirrors); used for the stop ids, the None check and the
            ``local`` walks.
        tree, device, barrier, time_limit_s, out: as in :func:`build_grammar_vocab_mask`.
        advance_only, on_verdicts: see :meth:`MaskWorkerPool.build` (mirror-only advances in
            the same round trip; a callback with the predicted verdicts, before ``barrier``).
        while_drafting: with a device tree and ``on_verdicts``, work for this thread while the
            drafted tree is on its way, after the predicted verdicts: called with
            :meth:`GrammarTree.arrived`, it should return soon after that turns true (the
            previous step's text work; the part left runs in ``barrier``). Ignored otherwise.
        local: rows of constrained requests whose grammar is not on their worker yet
            (:meth:`MaskWorkerPool.ready`): their ``requests`` entry is None and their host
            matcher, current after ``barrier``, walks their tree in this process.
        defer: when the pool has a device gate (``pool.device_gate``: CUDA), return
            before the workers' replies, the upload queued behind
            device-side waits on their flags (:mod:`~structspec.grammar.deferred_build`):
            the result's ``pending`` is set and :meth:`GrammarMaskResult.complete` reads the
            replies. Otherwise ignored.

    Returns:
        A :class:`GrammarMaskResult` whose ``bitmask_cpu`` is a view of the pool's slab (valid
        until the next build) and whose ``mirror`` holds the mirrors' verdicts, or None when
        no request has a matcher.

    Raises:
        ValueError: ``len(requests)`` or ``len(matchers)`` differs from the tree's batch size.
        MaskPoolError: a worker died or failed (a RuntimeError).
    """
    t0 = time.perf_counter()
    if all(m is None for m in matchers):
        if barrier is not None:
            barrier()
        return None
    device_tree = tree.copy is not None
    if device_tree and barrier is not None and on_verdicts is None:
        # the host matchers' barrier into the wait for the drafted tree; with mirrors
        # (``on_verdicts``) the barrier is theirs, and ``barrier`` (the previous step's text
        # work) must run after the predicted verdicts are applied (a verdict may end a request
        # or cut its run), i.e. inside ``pool.build``, once the build is sent
        barrier()
        barrier = None
    before_send = None
    if device_tree and on_verdicts is not None and while_drafting is not None:
        def before_send() -> None:
            while_drafting(tree.arrived)
            tree.resolve()
    else:
        tree.resolve()
    # the host buffers of a device tree's copy: read only after ``before_send`` resolved it
    next_token, next_sibling, draft_tokens = (tree.next_token_cpu, tree.next_sibling_cpu,
                                              tree.draft_tokens_cpu)
    bs, n = tree.shape
    if len(matchers) != bs or len(requests) != bs:
        raise ValueError(f"{len(matchers)} matchers / {len(requests)} requests for a tree "
                         f"batch of {bs}")
    local_walked: list[int] = []
    local_timed_out: list[int] = []
    host_side = barrier
    if local:
        rows_of = pool.slab[: bs * n].split(n)

        def host_side() -> None:
            if barrier is not None:
                barrier()
            for i in local:
                m = matchers[i]
                assert m is not None
                rows_of[i].fill_(-1)
                if m.is_terminated():
                    continue
                local_walked.append(i)
                if not walk_tree(m, next_token[i], next_sibling[i], draft_tokens[i],
                                 rows_of[i], time_limit_s):
                    local_timed_out.append(i)

    if defer and pool.device_gate:  # a gate needs the page-locked segment: CUDA
        handle = pool.build_deferred(requests, next_token, next_sibling, draft_tokens,
                                     time_limit_s=time_limit_s, while_waiting=host_side,
                                     advance_only=advance_only, on_verdicts=on_verdicts,
                                     host_rows=local, parents=tree.parents,
                                     before_send=before_send)
        gated = _gated_upload(handle, matchers, tree, local_walked, local_timed_out,
                              device=device, out=out, t0=t0)
        if gated is not None:
            return gated
        result = handle.finish()  # the device wait failed: the host waits, as without it
    else:
        result = pool.build(requests, next_token, next_sibling, draft_tokens,
                            time_limit_s=time_limit_s, while_waiting=host_side,
                            advance_only=advance_only, on_verdicts=on_verdicts,
                            host_rows=local, parents=tree.parents, before_send=before_send)
    # the workers settled their rows beside the walks; the local rows are settled here
    mask = _settle_and_upload(pool.slab[: bs * n], matchers, tree,
                              sorted(result.walked + local_walked),
                              sorted(result.timed_out + local_timed_out), device=device,
                              out=out, t0=t0, settled=result.settled)
    mask.mirror = result
    return mask


def _gated_upload(handle: DeferredPoolBuild, matchers: Sequence[AnyMatcher | None],
                  tree: GrammarTree, local_walked: Sequence[int],
                  local_timed_out: Sequence[int], *, device: torch.device | str,
                  out: torch.Tensor | None, t0: float) -> GrammarMaskResult | None:
    """The tail of a deferred pooled build: settle and cap the rows this process walked,
    queue the upload behind the workers' flags, and leave the replies to
    :meth:`GrammarMaskResult.complete`. None when the driver refused a wait (logged; the
    pool's gate is switched off): the caller reads the replies and uploads as without it.
    Any other error reads the replies before it is raised (a worker's failure then keeps the
    build's flags for the pool's close to release)."""
    draft_tokens = tree.draft_tokens_cpu
    bs, n = draft_tokens.shape
    rows, caps = handle.rows, handle.caps
    rejected = [0] * bs
    try:
        settle = sorted(set(local_walked).difference(local_timed_out))
        if settle:
            stop_ids = matchers[settle[0]].stop_token_ids  # type: ignore[union-attr]
            counts = settle_tree_rows_batch(rows, draft_tokens, tree.parents(), settle,
                                            stop_token_ids=stop_ids).tolist()
            for b in settle:
                rejected[b] = counts[b]
        for b in local_timed_out:
            caps[b] = 0
        bitmask_device, upload_done = upload_pinned_gated(
            rows, torch.device(device), handle.device_waits(torch.device(device)),
            out=None if out is None else out[: bs * n])
    except StreamWaitError as e:
        # Nothing was queued behind the wait that failed; the waits queued before it end once
        # their flags are stored (by the workers, or by close() after a failure).
        logger.warning("device-side wait on the mask workers' flags failed (%s); the host "
                       "waits for their replies from now on", e)
        handle.pool.device_gate = False
        return None
    except BaseException:
        handle.finish()  # the replies are read (a failure keeps the flags for close())
        raise
    mask = GrammarMaskResult(bitmask_device, rows, caps, [], rejected,
                             time.perf_counter() - t0, upload_done=upload_done,
                             caps_pinned=caps, gate=handle)

    def finish() -> None:
        result = handle.finish()
        mask.truncated_requests = sorted({*result.timed_out, *local_timed_out})
        for b, count in result.settled.items():
            rejected[b] = count
        mask.mirror = result

    mask.pending = finish
    # a graph capture (or any host sync) before the step reads the replies reads them first
    mask.unregister = register_before_host_sync(mask.complete)
    return mask


#: :func:`settle_tree_rows_batch` walks this many requests or fewer node by node in Python
#: (:func:`_settle_rows_lists`), more with numpy passes per tree column (the per-column
#: calls cost the same at any batch; the Python walk grows with it).
SETTLE_LIST_MAX_REQUESTS = 8


def settle_tree_rows_batch(bitmask: torch.Tensor, draft_tokens: torch.Tensor,
                           parents: torch.Tensor, requests: Sequence[int], *,
                           stop_token_ids: Sequence[int] = ()) -> np.ndarray:
    """Give the rejected and terminating nodes all-ones rows; count grammar-rejected drafts.

    xgrammar 0.2.8's ``traverse_draft_tree`` writes an all-zero row for a node whose token its
    parent's row forbids and for a node that terminates the grammar (a stop token); rows below
    those stay all ones. An all-zero row masks every logit to ``-inf``, which would turn a
    sampled bonus token into NaN probabilities; those rows are never used for an emitted token
    (a rejected node is unreachable; a run ends at its stop token), so they are reset to all
    ones, as in sglang's traversal.

    A node is *reached* when its parent was expanded: the root always is; a draft node is
    expanded when it is reached, allowed by its parent's row and not a stop token. The walk is
    vectorised over ``requests`` (one numpy pass per tree column; parents precede children,
    the :class:`~structspec.draft_tree.layout.VerifyTree` order), so its cost barely grows with the
    batch (~0.1 ms for 64 x 8 nodes against ~0.8 ms for a per-request Python walk).

    Args:
        bitmask: ``int32 [bs * N, W]`` the filled host rows of the whole batch, modified in
            place.
        draft_tokens: ``int64 [bs, N]`` host tokens per node (-1 = padding node, never
            reached).
        parents: ``int64 [bs, N]`` host parent per node (-1 for the root).
        requests: batch indices whose trees were fully traversed (others are left alone).
        stop_token_ids: the matchers' stop ids.

    Returns:
        ``int64 [bs]`` numpy array: per request, the reached draft nodes whose token the
        parent's row forbids (0 for requests not in ``requests``).
    """
    bs, n = draft_tokens.shape
    rejected = np.zeros(bs, dtype=np.int64)
    if not len(requests) or n < 2:
        return rejected
    words = bitmask.numpy().reshape(bs, n, -1)  # zero-copy view
    width = words.shape[2]
    if len(requests) <= SETTLE_LIST_MAX_REQUESTS:
        _settle_rows_lists(words, draft_tokens, parents, requests, stop_token_ids, rejected)
        return rejected
    req = np.asarray(requests, dtype=np.int64)
    toks = draft_tokens.numpy()[req]
    par = parents.numpy()[req].clip(min=0)
    valid = (toks >= 0) & (toks < 32 * width)
    safe = np.where(valid, toks, 0)
    # Bit of each node's token in its parent's row (read before any row is reset; a reset row
    # is never the parent of a reached node, so the order would not matter anyway).
    word = words[req[:, None], par, safe >> 5]
    allowed = valid & (((word >> (safe & 31)) & 1) == 1)
    is_stop = np.isin(toks, np.asarray(list(stop_token_ids), dtype=np.int64))
    k = len(req)
    rows = np.arange(k)
    expanded = np.zeros((k, n), dtype=bool)
    expanded[:, 0] = True
    reset = np.zeros((k, n), dtype=bool)
    bad = np.zeros(k, dtype=np.int64)
    for j in range(1, n):
        reached = expanded[rows, par[:, j]] & (toks[:, j] >= 0)
        expanded[:, j] = reached & allowed[:, j] & ~is_stop[:, j]
        reset[:, j] = reached & ~expanded[:, j]
        bad += reached & ~allowed[:, j]
    ri, nj = np.nonzero(reset)
    words[req[ri], nj] = -1
    rejected[req] = bad
    return rejected


def _settle_rows_lists(words: np.ndarray, draft_tokens: torch.Tensor, parents: torch.Tensor,
                       requests: Sequence[int], stop_token_ids: Sequence[int],
                       rejected: np.ndarray) -> None:
    """:func:`settle_tree_rows_batch`'s walk for a few requests, node by node in Python (the
    same rules; ``words``: the ``[bs, N, W]`` int32 view of the rows, ``rejected`` written in
    place). The vectorised walk is ~8 numpy calls per tree column whatever the batch (~150-270
    us for one 8-node tree on a 2-core EPYC VM, more than xgrammar's walk of that tree); this
    one costs a few Python operations per node."""
    stops = frozenset(stop_token_ids)
    toks_all, par_all = draft_tokens.tolist(), parents.tolist()
    for b in requests:
        rejected[b] = settle_request_rows(words[b], toks_all[b], par_all[b], stops)


def settle_request_rows(rows: np.ndarray, tokens: Sequence[int], parents: Sequence[int],
                        stop_token_ids: frozenset[int]) -> int:
    """:func:`settle_tree_rows_batch`'s rule for one request's walked rows, node by node (the
    mask workers settle their requests' rows with it, beside the walk).

    Args:
        rows: ``int32 [N, W]`` numpy view of the request's filled rows, modified in place.
        tokens: the ``N`` node tokens (-1 = padding node).
        parents: the ``N`` parent indices (-1 for the root; parents precede children).
        stop_token_ids: the matchers' stop ids.

    Returns:
        The reached draft nodes whose token the parent's row forbids.
    """
    n = len(tokens)
    limit = 32 * rows.shape[1]
    expanded = [True] + [False] * (n - 1)
    bad = 0
    for j in range(1, n):
        tok, p = tokens[j], max(parents[j], 0)
        if tok < 0 or not expanded[p]:
            continue  # padding, or under a node that was not expanded: not reached
        allowed = tok < limit and ((int(rows[p, tok >> 5]) >> (tok & 31)) & 1) == 1
        if allowed and tok not in stop_token_ids:
            expanded[j] = True
        else:
            rows[j] = -1  # rejected or terminating: all ones
            bad += not allowed
    return bad


def settle_tree_rows(rows: torch.Tensor, next_token: torch.Tensor,
                     next_sibling: torch.Tensor, draft_tokens: torch.Tensor, *,
                     stop_token_ids: Sequence[int] = ()) -> int:
    """:func:`settle_tree_rows_batch` for one request's rows (tests and callers with a
    single tree).

    Args:
        rows: ``int32 [N, W]`` one request's filled bitmask rows (host), modified in place.
        next_token, next_sibling, draft_tokens: ``int64 [N]`` host tensors of that request.
        stop_token_ids: the matcher's stop ids.

    Returns:
        The number of reached draft nodes whose token the parent's row forbids.
    """
    parents = parents_from_links(next_token[None], next_sibling[None])
    out = settle_tree_rows_batch(rows, draft_tokens[None], parents, [0],
                                 stop_token_ids=stop_token_ids)
    return int(out[0])
