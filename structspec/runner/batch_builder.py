"""Builds :class:`ForwardBatch` tensors for prefill and tree verify from host-side request state.

Shapes are built on the host with vectorised torch ops and moved to the device in one go per
tensor; the scheduler owns which requests go in, this module only lays them out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.kvcache.allocator import kv_slots_through, slots_for_positions
from structspec.kvcache.page_table import PageRows
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch


def page_table_tensor(pages: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``[B, P]`` int64 page table (padded with page 0, the sink) from per-request page lists."""
    width = max((len(p) for p in pages), default=1) or 1
    table = torch.zeros((len(pages), width), dtype=torch.int64)
    for i, p in enumerate(pages):
        if p:
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
    return table.to(device)


def build_prefill_batch(
    token_ids: Sequence[Sequence[int]],
    pages: Sequence[Sequence[int]],
    *,
    page_size: int,
    device: torch.device,
    num_cached: Sequence[int] | None = None,
) -> ForwardBatch:
    """Causal prefill of prompts, one padded row per request, over KV already cached.

    Request ``b`` computes its tokens ``num_cached[b]..len-1`` (written at those positions)
    and attends over positions ``0..len-1``: the first ``num_cached[b]`` come from KV already
    in its pages (a prefix-cache hit), the rest from this forward.

    Args:
        token_ids: per request, the whole prompt ids (non-empty).
        pages: per request, its KV pages (enough for its prompt).
        num_cached: per request, leading prompt tokens whose KV is already in its pages
            (``< len``: the last prompt token is always computed); None = all 0.

    Returns:
        A ForwardBatch of ``[B, Q]`` query rows (``Q`` = the longest computed part; row ``j``
        of request ``b`` is position ``num_cached[b] + j``) over ``[B, L]`` KV columns
        (``L`` = the longest prompt; column ``l`` = position ``l``), whose
        ``logits_indices`` select each request's last prompt token; ``causal_start`` =
        ``num_cached`` and no mask (:meth:`ForwardBatch.mask` builds it on demand).
    """
    bsz = len(token_ids)
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    starts = (torch.zeros(bsz, dtype=torch.int64) if num_cached is None
              else torch.tensor(list(num_cached), dtype=torch.int64))
    if bool(((starts < 0) | (starts >= lens)).any()):
        raise ValueError("num_cached must be in [0, prompt length) for every request")
    q_lens = lens - starts
    q, kv_len = int(q_lens.max()), int(lens.max())
    input_ids = torch.zeros((bsz, q), dtype=torch.int64)
    for i, t in enumerate(token_ids):
        start = int(starts[i])
        input_ids[i, : len(t) - start] = torch.tensor(t[start:], dtype=torch.int64)
    row = torch.arange(q).expand(bsz, q)
    valid = row < q_lens.unsqueeze(1)
    positions = torch.where(valid, starts.unsqueeze(1) + row, torch.zeros_like(row))
    table = page_table_tensor(pages, torch.device("cpu"))
    out_slots = torch.where(valid, slots_for_positions(table, positions, page_size), 0)
    col = torch.arange(kv_len).expand(bsz, kv_len)
    col_ok = col < lens.unsqueeze(1)
    kv_slots = torch.where(col_ok, slots_for_positions(table, torch.where(col_ok, col, 0),
                                                       page_size), 0)
    logits_indices = torch.arange(bsz) * q + q_lens - 1
    # causal: query at position p sees columns 0..p (cached prefix included), the rule
    # causal_start gives; no [B, Q, L] mask is built here (a long prompt's chunk: 2048 x 8192
    # entries), only by a backend that reads one (ForwardBatch.mask)
    return ForwardBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        out_slots=out_slots.to(device),
        kv_slots=kv_slots.to(device),
        attn_mask=None,
        logits_indices=logits_indices.to(device),
        causal_start=starts.to(device),
    )


def build_verify_batch(
    tree: VerifyTree,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> ForwardBatch:
    """Tree verify: node i of request b sits at position ``seq_lens[b] + i`` in the KV cache
    (rotary position ``seq_lens[b] + depth``) and sees the whole prefix plus its ancestors.

    Args:
        tree: ``N`` nodes per request, on the target device.
        seq_lens: ``[B]`` int64 committed KV length per request, target device.
        page_table: ``[B, P]`` int64 pages covering ``seq_lens + N`` positions, target device.

    Returns:
        A ForwardBatch with ``logits_indices`` = None (every node row is needed).
    """
    return build_verify_batch_from_tensors(
        tree.draft_tokens, tree.depth, tree.ancestor_mask, seq_lens, page_table,
        page_size=page_size,
    )


def build_verify_batch_from_tensors(
    draft_tokens: torch.Tensor,
    depth: torch.Tensor,
    ancestor_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> ForwardBatch:
    """:func:`build_verify_batch` on the three tree fields it reads (what a CUDA graph keeps as
    static inputs). Device ops only, shapes static: no host sync, capturable.

    Args:
        draft_tokens: ``[B, N]`` int64 (-1 = padding node, fed as token 0).
        depth: ``[B, N]`` int64 node depths.
        ancestor_mask: ``[B, N, N]`` bool, each row True at least on its diagonal.
        seq_lens: ``[B]`` int64 committed KV lengths (0 for a dummy row).
        page_table: ``[B, P]`` int64 pages covering ``seq_lens + N`` positions (a dummy row is
            all page 0, the sink: its writes land in page 0 and it attends only its own node).

    Returns:
        The verify ForwardBatch, ``kv_len = P * page_size``, all tensors on the inputs' device.
    """
    bsz, n = draft_tokens.shape
    out_slots, kv_slots, kv_pos = _appended_slots(seq_lens, n, page_table, page_size)
    kv_len = kv_pos.shape[1]
    prefix = kv_pos < seq_lens.unsqueeze(1)  # [B, L]
    tree_col = kv_pos - seq_lens.unsqueeze(1)  # [B, L], node index of tree columns
    in_tree = (tree_col >= 0) & (tree_col < n)
    gathered = torch.gather(
        ancestor_mask, 2, tree_col.clamp(0, n - 1).unsqueeze(1).expand(bsz, n, kv_len)
    )
    mask = prefix.unsqueeze(1) | (gathered & in_tree.unsqueeze(1))
    return ForwardBatch(
        input_ids=draft_tokens.clamp(min=0),
        positions=seq_lens.unsqueeze(1) + depth,
        out_slots=out_slots,
        kv_slots=kv_slots,
        attn_mask=mask,
        logits_indices=None,
    )


def build_chain_batch(
    token_ids: torch.Tensor,
    start: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> ForwardBatch:
    """Positions ``start[b] .. start[b] + N - 1`` of each request computed over the ``start[b]``
    before them, causally: a prompt chunk over its cached prefix (the prefill graphs). The
    layout of :func:`build_verify_batch_from_tensors` for a chain tree (node ``j`` at depth
    ``j``), with ``causal_start = start`` and no mask built. Device ops only, shapes static:
    capturable.

    Args:
        token_ids: ``[B, N]`` int64 (padding positions hold 0).
        start: ``[B]`` int64 positions already in each request's pages.
        page_table: ``[B, P]`` int64 pages covering ``start + N`` positions.

    Returns:
        The ForwardBatch, ``kv_len = P * page_size``, on the inputs' device.
    """
    n = token_ids.shape[1]
    out_slots, kv_slots, _ = _appended_slots(start, n, page_table, page_size)
    return ForwardBatch(
        input_ids=token_ids,
        positions=start.unsqueeze(1) + torch.arange(n, device=token_ids.device),
        out_slots=out_slots,
        kv_slots=kv_slots,
        attn_mask=None,
        logits_indices=None,
        causal_start=start,
    )


def _appended_slots(seq_lens: torch.Tensor, n: int, page_table: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of ``n`` entries appended after ``seq_lens[b]`` cached ones: ``out_slots``
    ``[B, n]`` (where they are written), ``kv_slots`` ``[B, L]`` (every position up to
    ``seq_lens + n`` in order, then the sink 0) and the column positions ``[B, L]``,
    ``L = P * page_size`` (static per page-table width: no host sync)."""
    out_pos = seq_lens.unsqueeze(1) + torch.arange(n, device=seq_lens.device)
    out_slots = slots_for_positions(page_table, out_pos, page_size)
    kv_slots, kv_pos = kv_slots_through(page_table, seq_lens + n, page_size)
    return out_slots, kv_slots, kv_pos


def page_table_array(pages: Sequence[Sequence[int]] | PageRows, width: int) -> np.ndarray:
    """``int64 [B, width]`` host page table: request ``b``'s first ``width`` pages, padded
    with page 0 (the sink). ``pages``: per-request lists, or a
    :class:`~structspec.kvcache.page_table.PageRows` (one numpy gather: what the scheduler
    passes, so no per-request work)."""
    if isinstance(pages, PageRows):
        return pages.take(width)
    return np.array(page_rows(pages, width, len(pages)), dtype=np.int64).reshape(
        len(pages), width)


def fill_seq_lens_and_pages(out: np.ndarray, seq_lens: Sequence[int],
                            pages: Sequence[Sequence[int]] | PageRows, need: int, rows: int,
                            *, width: int | None = None) -> None:
    """Write the host head of a verify's staged inputs, ``seq_lens [rows] | page_table
    [rows, width]``, into ``out`` (what the CUDA verify paths copy to the device at once).

    Request ``b < B`` gets its ``seq_len`` and its first ``need`` pages, padded with page 0 to
    ``width`` (default ``need``); rows ``B..rows-1`` (a graph bucket's dummy rows) are all 0.

    Args:
        out: ``int64 [rows * (1 + width)]`` host array (a pinned buffer's numpy view).
        seq_lens: ``B <= rows`` committed lengths (host ints).
        pages: the batch's pages (lists or :class:`~structspec.kvcache.page_table.PageRows`).
        need: pages each row keeps (``<= width``).
    """
    width = need if width is None else width
    bsz = len(seq_lens)
    out[:bsz] = seq_lens
    out[bsz:rows] = 0
    table = out[rows : rows * (1 + width)].reshape(rows, width)
    table[:bsz, :need] = page_table_array(pages, need)
    table[:bsz, need:] = 0
    table[bsz:] = 0


def page_rows(pages: Sequence[Sequence[int]], width: int, rows: int) -> list[int]:
    """Row-major ``[rows, width]`` page table as a flat host list: request ``b``'s first
    ``width`` pages, padded with page 0 (the sink); rows past ``len(pages)`` are all 0."""
    flat: list[int] = []
    for p in pages:
        row = list(p[:width])
        flat += row
        flat += [0] * (width - len(row))
    flat += [0] * ((rows - len(pages)) * width)
    return flat


def accepted_kv_moves(
    accept_nodes: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination slots that compact each accepted path into consecutive positions.

    The node at depth d of the accepted path was written at position ``seq_len + node``; it
    must live at ``seq_len + d``. Entries past the path map to the sink (slot 0 -> 0).

    Returns:
        ``(src_slots, dst_slots)``, each ``[B * N]`` int64 on the device of the inputs.
    """
    bsz, n = accept_nodes.shape
    depth = torch.arange(n, device=accept_nodes.device).expand(bsz, n)
    valid = accept_nodes >= 0
    src_pos = seq_lens.unsqueeze(1) + accept_nodes.clamp(min=0)
    dst_pos = seq_lens.unsqueeze(1) + depth
    src = torch.where(valid, slots_for_positions(page_table, src_pos, page_size), 0)
    dst = torch.where(valid, slots_for_positions(page_table, dst_pos, page_size), 0)
    return src.flatten(), dst.flatten()


def compact_accepted_kv(
    kv_pool: KVPool,
    accept_nodes: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    page_size: int,
) -> None:
    """Move each accepted path's KV to consecutive positions (:func:`accepted_kv_moves` and
    one :meth:`KVPool.copy_slots`); rejected nodes' KV is left in slots past the new length,
    where the next step overwrites it. No host sync, so a CUDA graph can record it.

    Args:
        kv_pool: the target KV pool.
        accept_nodes: ``[B, N]`` int64 accepted node per depth, -1 past the path (device).
        seq_lens: ``[B]`` int64 committed lengths the verify forward ran with (device).
        page_table: ``[B, P]`` int64 pages the forward wrote through (device).
        page_size: tokens per KV page.

    With ``N == 1`` (plain decode) nothing moves: node 0 is already in place.
    """
    if accept_nodes.shape[1] <= 1:
        return
    src, dst = accepted_kv_moves(accept_nodes, seq_lens, page_table, page_size=page_size)
    kv_pool.copy_slots(src, dst)
