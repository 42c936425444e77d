"""Page allocation for the KV pool: which pages a request owns, and the slot of each position."""

from __future__ import annotations

import torch

from structspec.kernels import index_kernels_usable


class PageAllocator:
    """Hands out KV pages from a free list. Page 0 is never handed out (padding sink).

    Host-only bookkeeping: page ids are Python ints; slots are computed on demand.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids first, which keeps early requests' KV compact.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        # 1 = the page is free (page 0, the sink, never is): the double-free check of
        # ``free`` reads these flags, O(pages freed), where a set of the free list cost
        # O(num_pages) per call (~0.5 ms at 16k pages, for every finished request).
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free[0] = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages.

        Raises:
            MemoryError: when fewer pages are free (callers check :meth:`can_allocate` first).
        """
        if num_pages > len(self._free):
            raise MemoryError(f"KV cache full: need {num_pages} pages, {len(self._free)} free")
        taken = self._free[len(self._free) - num_pages :]
        del self._free[len(self._free) - num_pages :]
        is_free = self._is_free
        for p in taken:
            is_free[p] = 0
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Double frees are a bug and raise ``ValueError``."""
        if not pages:
            return
        is_free = self._is_free
        for i, p in enumerate(pages):
            if p <= 0 or p >= self.num_pages or is_free[p]:
                for q in pages[:i]:  # a refused call frees nothing
                    is_free[q] = 0
                raise ValueError(f"invalid or double free of KV page {p}")
            is_free[p] = 1  # a page listed twice in this call is caught at its second entry
        self._free.extend(sorted(pages, reverse=True))


def slots_for_positions(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Map token positions to KV-pool slots through a page table.

    Args:
        page_table: ``[B, P]`` int64, page id of each request's p-th page (any device).
        positions: ``[B, T]`` int64 positions (``< P * page_size``), same device.
        page_size: tokens per page.

    Returns:
        ``[B, T]`` int64 slots ``page_table[b, pos // page_size] * page_size + pos % page_size``.
    """
    if _index_kernels(page_table):  # one launch instead of five (inside CUDA graphs too)
        from structspec.kernels import paging

        return paging.slots_for_positions(page_table, positions, page_size)
    page_idx = torch.div(positions, page_size, rounding_mode="floor")
    pages = torch.gather(page_table, 1, page_idx)
    return pages * page_size + positions % page_size


def kv_slots_through(page_table: torch.Tensor, lengths: torch.Tensor,
                     page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV columns of a forward: each request's slots for positions ``0 .. lengths[b] - 1``
    in order, then the sink slot 0, over ``L = P * page_size`` columns (static per page-table
    width: no host sync, capturable).

    Args:
        page_table: ``[B, P]`` int64 (any device).
        lengths: ``[B]`` int64 positions each request attends over (``>= 1``), same device.
        page_size: tokens per page.

    Returns:
        ``kv_slots`` ``[B, L]`` int64 and the column positions ``kv_pos`` ``[B, L]`` int64 (an
        expanded ``arange``, for the caller's mask).
    """
    bsz = page_table.shape[0]
    kv_len = int(page_table.shape[1]) * page_size
    kv_pos = torch.arange(kv_len, device=page_table.device).expand(bsz, kv_len)
    if _index_kernels(page_table):  # one launch instead of ~10
        from structspec.kernels import paging

        return paging.kv_slots_through(page_table, lengths, page_size), kv_pos
    total = lengths.unsqueeze(1)
    kv_slots = slots_for_positions(page_table, torch.minimum(kv_pos, total - 1), page_size)
    return torch.where(kv_pos < total, kv_slots, torch.zeros_like(kv_slots)), kv_pos


def _index_kernels(page_table: torch.Tensor) -> bool:
    """Whether the page lookups run as :mod:`structspec.kernels.paging` launches: an int64
    table where :func:`~structspec.kernels.index_kernels_usable` says so."""
    return page_table.dtype == torch.int64 and index_kernels_usable(page_table)
