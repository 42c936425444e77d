"""Forward batches of the model-based drafters' draft network (draft model, EAGLE).

Draft KV layout per request (pages from the drafter's own
:class:`~structspec.kvcache.allocator.PageAllocator`): the drafter owns ``E`` *committed
entries* at positions ``0..E-1`` (draft model: one per history token; EAGLE: one per (token,
target feature) pair, see :mod:`structspec.speculative.eagle`), followed by a scratch area of
``(depth - 1) * topk`` slots where frontier node ``j`` of expansion step ``s`` writes its KV at
position ``E + (s - 1) * topk + j`` (its rotary position is ``E + s - 1``). After verify the
committed history only grows by appending, so entries ``0..kv_len-1`` stay valid and the next
propose re-feeds entries ``kv_len..E-1`` (at least the last one, whose output seeds the root's
children) in one batched causal *catch-up* forward.

Three layouts, all :class:`~structspec.layers.forward_batch.ForwardBatch`:

* :func:`build_extend_batch`: the eager catch-up, laid out on the host and staged to the device
  (one non-blocking H2D copy per tensor on CUDA, through the drafter's
  :class:`~structspec.staging.Staging`);
* :func:`build_catch_up_batch`: the same layout with a fixed query width, built on the device
  from a few staged ints (what the propose CUDA graph records,
  :mod:`structspec.speculative.draft_graph`);
* :func:`build_frontier_batch`: one expansion step over the frontier (tree attention into the
  scratch area), built on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from structspec.kernels import index_kernels_usable
from structspec.kvcache.allocator import kv_slots_through, slots_for_positions
from structspec.layers.forward_batch import ForwardBatch
from structspec.staging import Staging, to_device


def padded_rows(token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, Q], lens [B])`` int64 CPU tensors: row ``b`` holds ``token_ids[b]`` then zeros,
    ``Q`` the longest row (non-empty rows). One conversion of all the ids, not one tensor per
    row (the catch-up of every request is laid out each propose)."""
    lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    ids = np.zeros((len(token_ids), int(lens.max())), dtype=np.int64)
    ids[np.arange(ids.shape[1]) < lens[:, None]] = list(itertools.chain.from_iterable(token_ids))
    return torch.from_numpy(ids), torch.from_numpy(lens)


def build_extend_batch(
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    page_table: torch.Tensor,
    *,
    page_size: int,
    device: torch.device,
    staging: Staging | None = None,
) -> ForwardBatch:
    """Causal extend: request b appends ``token_ids[b]`` at positions ``starts[b]..`` after
    ``starts[b]`` entries already in the draft KV (a prefill when ``starts[b] == 0``).

    The layout is computed on the host; each of its six tensors then goes to ``device``
    through ``staging`` (a pinned ring slot and one non-blocking H2D copy, stream ordered
    before the draft forward that reads it; no host sync), or by a plain copy without it.

    Args:
        token_ids: per request, the non-empty tokens to append.
        starts: per request, the number of entries already cached.
        page_table: ``[B, P]`` int64 host page table covering ``starts[b] + len(token_ids[b])``.
        page_size: KV slots per page.
        device: the draft network's device.
        staging: the drafter's pinned staging on CUDA, None on CPU.

    Returns:
        A ForwardBatch on ``device``, ``Q = max(len(token_ids[b]))``: ``input_ids``,
        ``positions``, ``out_slots`` ``[B, Q]`` int64, ``kv_slots`` ``[B, P * page_size]``
        int64, ``logits_indices`` ``[B]`` int64 (the flat row of each request's last new
        token), ``causal_start`` ``[B]`` int64 (``starts``: the causal rule, no mask built;
        :meth:`ForwardBatch.mask` builds it for a backend that reads one). Padding query rows
        write slot 0.
    """
    input_ids, lens = padded_rows(token_ids)
    start = torch.tensor(list(starts), dtype=torch.int64)
    bsz, q = input_ids.shape
    col = torch.arange(q).expand(bsz, q)
    valid = col < lens.unsqueeze(1)
    positions = torch.where(valid, start.unsqueeze(1) + col, torch.zeros_like(col))
    out_slots = torch.where(valid, slots_for_positions(page_table, positions, page_size), 0)
    kv_slots, _ = kv_slots_through(page_table, start + lens, page_size)
    logits_indices = torch.arange(bsz) * q + lens - 1
    return ForwardBatch(
        input_ids=to_device(input_ids, device, staging),
        positions=to_device(positions, device, staging),
        out_slots=to_device(out_slots, device, staging),
        kv_slots=to_device(kv_slots, device, staging),
        attn_mask=None,  # the causal rule: a long catch-up's [B, Q, L] mask is never built
        logits_indices=to_device(logits_indices, device, staging),
        causal_start=to_device(start, device, staging),
    )


@dataclass(frozen=True)
class FrontierLayout:
    """What the expansion steps' forward batches share within one propose: everything but the
    frontier tokens and the scratch mask (all device tensors, built once by
    :func:`frontier_layout`; the steps of one propose differ only in which scratch columns
    each node sees). Built per step, it was ~12 more launches per expansion step inside the
    propose graph.

    Attributes:
        base_len: ``[B]`` int64 committed draft entries (the scratch starts there).
        kv_slots: ``[B, L]`` int64 KV columns (``L = P * page_size``), the sink past the end.
        scratch_slots: ``[B, S]`` int64 KV slot of each scratch position.
        prefix: ``[B, L]`` bool, the columns of committed entries (every node sees them).
        scratch_col: ``[B, L]`` int64 scratch column of each KV column, clamped into
            ``0 .. S - 1`` (a gather index into the scratch mask).
        in_scratch: ``[B, L]`` bool, the columns inside the scratch area.

    The last three are None where the index kernels build each step's mask from
    ``base_len`` in one launch (:func:`structspec.kernels.paging.frontier_mask`).
    """

    base_len: torch.Tensor
    kv_slots: torch.Tensor
    scratch_slots: torch.Tensor
    prefix: torch.Tensor | None = None
    scratch_col: torch.Tensor | None = None
    in_scratch: torch.Tensor | None = None


def frontier_layout(base_len: torch.Tensor, scratch: int, page_table: torch.Tensor, *,
                    page_size: int) -> FrontierLayout:
    """The :class:`FrontierLayout` of one propose (device ops only, no syncs).

    Args:
        base_len: ``[B]`` int64 committed draft entries per request.
        scratch: ``S``, the scratch columns (``(depth - 1) * topk``).
        page_table: ``[B, P]`` int64, covering ``base_len + S`` positions.
        page_size: KV slots per page.
    """
    kv_slots, kv_pos = kv_slots_through(page_table, base_len + scratch, page_size)
    scratch_pos = base_len.unsqueeze(1) + torch.arange(scratch, device=base_len.device)
    scratch_slots = slots_for_positions(page_table, scratch_pos, page_size)
    if index_kernels_usable(base_len):  # masks built per step by frontier_mask
        return FrontierLayout(base_len=base_len, kv_slots=kv_slots, scratch_slots=scratch_slots)
    col = kv_pos - base_len.unsqueeze(1)
    return FrontierLayout(
        base_len=base_len,
        kv_slots=kv_slots,
        scratch_slots=scratch_slots,
        prefix=col < 0,
        scratch_col=col.clamp(0, max(scratch - 1, 0)),
        in_scratch=(col >= 0) & (col < scratch),
    )


def build_frontier_batch(
    tokens: torch.Tensor, step: int, scratch_mask: torch.Tensor, layout: FrontierLayout,
) -> ForwardBatch:
    """One expansion step's draft forward over the frontier (all on the device, no syncs).

    Frontier node j of step ``s`` (depth ``s``) has rotary position ``base_len + s - 1`` and
    writes its KV at position ``base_len + (s - 1) * k + j``; it sees the ``base_len``
    committed entries and the scratch columns set in ``scratch_mask`` (its ancestors and
    itself).

    Args:
        tokens: ``[B, k]`` int64 frontier tokens.
        step: 1-based expansion step.
        scratch_mask: ``[B, k, S]`` bool, S = scratch columns.
        layout: this propose's :func:`frontier_layout` (same ``S``).

    All tensors on the draft device.

    Returns:
        The ForwardBatch on that device: ``input_ids``, ``positions``, ``out_slots`` ``[B, k]``
        int64, ``kv_slots`` ``[B, P * page_size]`` int64, ``attn_mask``
        ``[B, k, P * page_size]`` bool, no ``logits_indices`` (every row is read).
    """
    bsz, k = tokens.shape
    kv_len = layout.kv_slots.shape[1]
    first = (step - 1) * k
    if layout.prefix is None:  # the index kernels' layout: mask and positions in one launch
        from structspec.kernels.paging import frontier_mask

        mask, positions = frontier_mask(scratch_mask, layout.base_len, kv_len, step - 1)
    else:
        assert layout.scratch_col is not None and layout.in_scratch is not None
        seen = torch.gather(scratch_mask, 2,
                            layout.scratch_col.unsqueeze(1).expand(bsz, k, kv_len))
        mask = layout.prefix.unsqueeze(1) | (seen & layout.in_scratch.unsqueeze(1))
        positions = (layout.base_len + step - 1).unsqueeze(1).expand(bsz, k).contiguous()
    return ForwardBatch(
        input_ids=tokens,
        positions=positions,
        out_slots=layout.scratch_slots[:, first : first + k],
        kv_slots=layout.kv_slots,
        attn_mask=mask,
        logits_indices=None,
    )


def build_catch_up_batch(
    tokens: torch.Tensor,
    start: torch.Tensor,
    qlen: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> ForwardBatch:
    """Fixed-shape causal catch-up built on the device (no host sync, capturable).

    Same layout as :func:`build_extend_batch` with ``Q`` query rows per
    request: row ``b`` appends ``tokens[b, :qlen[b]]`` at positions ``start[b]..``; a dummy row
    (``qlen == 0``) is fed as one token at position 0 (its page-table row must be all page 0).

    Args:
        tokens: ``[B, Q]`` int64 entry tokens (0 past ``qlen``).
        start: ``[B]`` int64 entries already cached.
        qlen: ``[B]`` int64 entries to append (``0 <= qlen <= Q``).
        page_table: ``[B, P]`` int64 covering ``start + max(qlen, 1)`` positions.

    Returns:
        The ForwardBatch (``[B, Q]`` queries over ``[B, P * page_size]`` KV slots) on the inputs'
        device; ``logits_indices [B]`` = the flat row of each request's last new entry;
        ``causal_start = start`` (the causal rule, as :func:`build_extend_batch`: no
        ``[B, Q, L]`` mask is built, and the causal attention kernel reads none). A padding
        row ``q >= qlen`` then sees columns up to ``start + q``, the ones past its request's
        entries being the sink slot 0: its output is never read and it writes the sink.
    """
    bsz, q = tokens.shape
    device = tokens.device
    if index_kernels_usable(start) and page_table.dtype == torch.int64:  # one launch instead of ~14
        from structspec.kernels.paging import catch_up_layout

        positions, out_slots, kv_slots, logits_indices = catch_up_layout(
            start, qlen, q, page_table, page_size)
        return ForwardBatch(input_ids=tokens, positions=positions, out_slots=out_slots,
                            kv_slots=kv_slots, attn_mask=None, logits_indices=logits_indices,
                            causal_start=start)
    length = qlen.clamp(min=1)
    col = torch.arange(q, device=device).expand(bsz, q)
    valid = col < length.unsqueeze(1)
    zeros = torch.zeros_like(col)
    positions = torch.where(valid, start.unsqueeze(1) + col, zeros)
    out_slots = torch.where(valid, slots_for_positions(page_table, positions, page_size), zeros)
    kv_slots, _ = kv_slots_through(page_table, start + length, page_size)
    logits_indices = torch.arange(bsz, device=device) * q + length - 1
    return ForwardBatch(input_ids=tokens, positions=positions, out_slots=out_slots,
                        kv_slots=kv_slots, attn_mask=None, logits_indices=logits_indices,
                        causal_start=start)
