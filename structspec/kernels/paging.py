"""Page-table lookups and the draft frontier's attention mask, one Triton launch each.

Inside a propose CUDA graph these small index computations are a large share of the replayed
kernels: :func:`~structspec.kvcache.allocator.slots_for_positions` is 5 torch ops (divide,
gather, multiply, modulo, add), :func:`~structspec.kvcache.allocator.kv_slots_through` ~10, an
expansion step's frontier mask ~6 (``benchmarks/propose_launches.py``). The functions here
compute the same integers and booleans, element for element, in one launch; the allocator
and the draft batches dispatch to them for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structspec.kernels import next_pow2

_BLOCK = 256


@triton.jit
def _slot(table, num_pages, pos, page_size, valid):
    """The KV slot of ``pos`` through one request's page-table row ``table``; 0 (the sink)
    where ``valid`` is False or ``pos`` lies outside the row (no read there)."""
    page_idx = pos // page_size
    inside = valid & (pos >= 0) & (page_idx < num_pages)
    page = tl.load(table + page_idx, mask=inside, other=0)
    return tl.where(inside, page * page_size + pos % page_size, 0)


@triton.jit
def _slots_kernel(PageTable, stride_pt, num_pages, Positions, stride_pb, stride_pt2, Out, t_len,
                  page_size, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < t_len
    pos = tl.load(Positions + b * stride_pb + t * stride_pt2, mask=ok, other=0)
    # a position outside the table maps to the sink slot 0 (never another page's slot)
    tl.store(Out + b * t_len + t, _slot(PageTable + b * stride_pt, num_pages, pos, page_size, ok),
             mask=ok)


def slots_for_positions(page_table: torch.Tensor, positions: torch.Tensor,
                        page_size: int) -> torch.Tensor:
    """``page_table[b, pos // page_size] * page_size + pos % page_size`` in one launch.

    Args:
        page_table: ``[B, P]`` int64, unit stride on ``P``; CUDA (or CPU under the
            interpreter).
        positions: ``[B, T]`` int64 positions ``0 <= pos < P * page_size`` (any strides, e.g.
            an expanded row); a position outside maps to the sink slot 0 (the torch op
            raises instead).
        page_size: tokens per page.

    Returns:
        ``[B, T]`` int64 slots, contiguous.

    Raises:
        ValueError: ``positions`` and ``page_table`` disagree on ``B``.
    """
    bsz, t_len = positions.shape
    if page_table.shape[0] != bsz:
        raise ValueError(f"positions {tuple(positions.shape)} and page_table "
                         f"{tuple(page_table.shape)} must have the same rows")
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    out = torch.empty((bsz, t_len), dtype=torch.int64, device=positions.device)
    if bsz and t_len:
        block = min(_BLOCK, next_pow2(t_len))
        _slots_kernel[(bsz, triton.cdiv(t_len, block))](
            page_table, page_table.stride(0), page_table.shape[1], positions,
            positions.stride(0), positions.stride(1), out, t_len, page_size, BLOCK=block,
            num_warps=4)
    return out


@triton.jit
def _kv_slots_kernel(PageTable, stride_pt, num_pages, Lengths, Out, kv_len, page_size,
                     BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < kv_len
    total = tl.load(Lengths + b)
    slot = _slot(PageTable + b * stride_pt, num_pages, col, page_size, ok & (col < total))
    tl.store(Out + b * kv_len + col, slot, mask=ok)


def kv_slots_through(page_table: torch.Tensor, lengths: torch.Tensor,
                     page_size: int) -> torch.Tensor:
    """Each request's KV slots of positions ``0 .. lengths[b] - 1`` then the sink slot 0, over
    ``L = P * page_size`` columns, in one launch
    (:func:`structspec.kvcache.allocator.kv_slots_through`'s ``kv_slots``).

    Args:
        page_table: ``[B, P]`` int64, unit stride on ``P``; CUDA (or CPU under the
            interpreter).
        lengths: ``[B]`` (or ``[1]``, broadcast) int64, ``>= 1``.
        page_size: tokens per page.

    Returns:
        ``[B, L]`` int64, contiguous.

    Raises:
        RuntimeError: ``lengths`` does not broadcast to ``[B]`` (as the torch op).
    """
    bsz, num_pages = page_table.shape
    lengths = lengths.reshape(-1).expand(bsz)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    kv_len = num_pages * page_size
    out = torch.empty((bsz, kv_len), dtype=torch.int64, device=page_table.device)
    if bsz and kv_len:
        block = min(_BLOCK, next_pow2(kv_len))
        _kv_slots_kernel[(bsz, triton.cdiv(kv_len, block))](
            page_table, page_table.stride(0), num_pages, lengths.contiguous(), out, kv_len,
            page_size, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _frontier_mask_kernel(ScratchMask, BaseLen, Mask, Positions, k, scratch, kv_len, position,
                          BLOCK: tl.constexpr, K_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    ok = col < kv_len
    base = tl.load(BaseLen + b)
    rel = col - base  # scratch column of each KV column (negative: a committed entry)
    prefix = rel < 0
    in_scratch = (rel >= 0) & (rel < scratch)
    for j in range(k):
        seen = tl.load(ScratchMask + (b * k + j) * scratch + rel, mask=ok & in_scratch, other=0)
        tl.store(Mask + (b * k + j) * kv_len + col, (prefix | (seen != 0)).to(tl.uint8),
                 mask=ok)
    if blk == 0:
        nodes = tl.arange(0, K_PAD)
        tl.store(Positions + b * k + nodes, base + position + tl.zeros([K_PAD], tl.int64),
                 mask=nodes < k)


def frontier_mask(scratch_mask: torch.Tensor, base_len: torch.Tensor, kv_len: int,
                  position_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expansion step's attention mask and rotary positions in one launch
    (:func:`structspec.speculative.draft_batches.build_frontier_batch`'s).

    Frontier node ``j`` of request ``b`` sees KV column ``l`` when ``l < base_len[b]`` (a
    committed entry) or ``scratch_mask[b, j, l - base_len[b]]`` (a scratch column it sees).

    Args:
        scratch_mask: ``[B, k, S]`` bool, contiguous; CUDA (or CPU under the interpreter).
        base_len: ``[B]`` int64 committed draft entries, contiguous.
        kv_len: ``L``, the KV columns of the step's batch.
        position_offset: ``step - 1``: every node's rotary position is ``base_len + step - 1``.

    Returns:
        ``(mask [B, k, L] bool, positions [B, k] int64)``.
    """
    bsz, k, scratch = scratch_mask.shape
    device = scratch_mask.device
    mask = torch.empty((bsz, k, kv_len), dtype=torch.bool, device=device)
    positions = torch.empty((bsz, k), dtype=torch.int64, device=device)
    if bsz and k:
        block = min(_BLOCK, next_pow2(kv_len))
        _frontier_mask_kernel[(bsz, triton.cdiv(kv_len, block))](
            scratch_mask.contiguous().view(torch.uint8), base_len.contiguous(),
            mask.view(torch.uint8), positions, k, scratch, kv_len, position_offset,
            BLOCK=block, K_PAD=next_pow2(k), num_warps=4)
    return mask, positions


@triton.jit
def _catch_up_kernel(PageTable, stride_pt, num_pages, Start, QLen, Positions, OutSlots, KvSlots,
                     LogitsIdx, q, kv_len, page_size, BLOCK_Q: tl.constexpr,
                     BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    start = tl.load(Start + b)
    length = tl.maximum(tl.load(QLen + b), 1)  # a dummy row is one token at its start
    table = PageTable + b * stride_pt
    if blk == 0:
        col = tl.arange(0, BLOCK_Q)
        ok = col < q
        valid = col < length
        pos = tl.where(valid, start + col, 0)
        tl.store(Positions + b * q + col, pos, mask=ok)
        tl.store(OutSlots + b * q + col, _slot(table, num_pages, pos, page_size, ok & valid),
                 mask=ok)
        tl.store(LogitsIdx + b, b * q + length - 1)
    # the KV columns: positions 0 .. start + length - 1 in order, then the sink slot 0
    kv = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    ok_kv = kv < kv_len
    tl.store(KvSlots + b * kv_len + kv,
             _slot(table, num_pages, kv, page_size, ok_kv & (kv < start + length)), mask=ok_kv)


def catch_up_layout(
    start: torch.Tensor, qlen: torch.Tensor, q: int, page_table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed-shape causal catch-up's layout in one launch
    (:func:`structspec.speculative.draft_batches.build_catch_up_batch`'s integer tensors).

    Args:
        start: ``[B]`` int64 entries already cached, contiguous; CUDA (or CPU under the
            interpreter).
        qlen: ``[B]`` int64 entries to append (0 = a dummy row, laid out as one entry).
        q: ``Q``, the query rows per request.
        page_table: ``[B, P]`` int64 covering ``start + max(qlen, 1)`` positions.
        page_size: tokens per page.

    Returns:
        ``(positions [B, Q], out_slots [B, Q], kv_slots [B, P * page_size],
        logits_indices [B])``, int64.
    """
    bsz, num_pages = page_table.shape
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    device = page_table.device
    kv_len = num_pages * page_size
    positions = torch.empty((bsz, q), dtype=torch.int64, device=device)
    out_slots = torch.empty((bsz, q), dtype=torch.int64, device=device)
    kv_slots = torch.empty((bsz, kv_len), dtype=torch.int64, device=device)
    logits_indices = torch.empty(bsz, dtype=torch.int64, device=device)
    if bsz:
        block_l = min(_BLOCK, next_pow2(kv_len))
        _catch_up_kernel[(bsz, triton.cdiv(kv_len, block_l))](
            page_table, page_table.stride(0), num_pages, start.contiguous(), qlen.contiguous(),
            positions, out_slots, kv_slots, logits_indices, q, kv_len, page_size,
            BLOCK_Q=next_pow2(q), BLOCK_L=block_l, num_warps=4)
    return positions, out_slots, kv_slots, logits_indices
