"""Page allocator and slot mapping."""

from __future__ import annotations

import pytest
import torch

from structspec.kvcache.allocator import PageAllocator, slots_for_positions


def test_allocate_free_and_double_free() -> None:
    alloc = PageAllocator(num_pages=5, page_size=4)
    assert alloc.capacity_tokens == 16 and alloc.pages_for(9) == 3
    a = alloc.allocate(3)
    assert 0 not in a and len(set(a)) == 3
    assert not alloc.can_allocate(2)
    with pytest.raises(MemoryError):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free_pages == 4
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[0]])


def test_slots_for_positions() -> None:
    table = torch.tensor([[3, 1], [2, 4]])
    pos = torch.tensor([[0, 3, 4, 7], [1, 2, 5, 6]])
    assert slots_for_positions(table, pos, 4).tolist() == [[12, 15, 4, 7], [9, 10, 17, 18]]


def test_free_refuses_a_page_twice_in_one_call_and_frees_nothing_then() -> None:
    alloc = PageAllocator(num_pages=6, page_size=4)
    a = alloc.allocate(3)
    with pytest.raises(ValueError, match=f"double free of KV page {a[1]}"):
        alloc.free([a[0], a[1], a[1]])
    with pytest.raises(ValueError, match="invalid or double free of KV page 0"):
        alloc.free([a[2], 0])
    assert alloc.num_free_pages == 2  # the refused calls freed nothing
    alloc.free(a)
    assert alloc.num_free_pages == 5
    assert sorted(alloc.allocate(5)) == [1, 2, 3, 4, 5]
