"""Page-lookup and frontier-mask kernels against the torch ops they replace (equal element for
element), and the draft batches built either way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

import structspec.kernels as kernels  # noqa: E402
from structspec.kernels import paging  # noqa: E402
from structspec.kvcache import allocator  # noqa: E402
from structspec.speculative.draft_batches import (  # noqa: E402
    build_catch_up_batch,
    build_frontier_batch,
    frontier_layout,
)


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """The torch reference path (index kernels off) inside the block."""
    old = kernels.INDEX_KERNELS
    kernels.INDEX_KERNELS = False
    try:
        yield
    finally:
        kernels.INDEX_KERNELS = old


def _table(bsz: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (bsz, pages), generator=g)


@pytest.mark.parametrize("bsz,pages,page_size,t_len", [(3, 4, 16, 9), (1, 1, 1, 1),
                                                       (5, 40, 16, 600), (2, 7, 4, 3)])
def test_slots_for_positions_matches_torch(dev: torch.device, bsz: int, pages: int,
                                           page_size: int, t_len: int) -> None:
    table = _table(bsz, pages, seed=pages)
    g = torch.Generator().manual_seed(t_len)
    positions = torch.randint(0, pages * page_size, (bsz, t_len), generator=g)
    with torch_ops():
        ref = allocator.slots_for_positions(table, positions, page_size)
    got = paging.slots_for_positions(table.to(dev), positions.to(dev), page_size)
    assert torch.equal(got.cpu(), ref)
    # an expanded (stride-0) row of positions, as the batch builders pass
    row = torch.arange(min(t_len, pages * page_size)).expand(bsz, -1)
    with torch_ops():
        ref = allocator.slots_for_positions(table, row, page_size)
    got = paging.slots_for_positions(table.to(dev), row.to(dev), page_size)
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("bsz,pages,page_size", [(3, 4, 16), (1, 1, 16), (4, 33, 16), (2, 5, 3)])
def test_kv_slots_through_matches_torch(dev: torch.device, bsz: int, pages: int,
                                        page_size: int) -> None:
    table = _table(bsz, pages, seed=pages + 1)
    g = torch.Generator().manual_seed(pages)
    lengths = torch.randint(1, pages * page_size + 1, (bsz,), generator=g)
    with torch_ops():
        ref, ref_pos = allocator.kv_slots_through(table, lengths, page_size)
    assert kernels.index_kernels_usable(table.to(dev))
    got, got_pos = allocator.kv_slots_through(table.to(dev), lengths.to(dev), page_size)
    assert torch.equal(got.cpu(), ref) and torch.equal(got_pos.cpu(), ref_pos)


@pytest.mark.parametrize("k,depth,step", [(2, 4, 1), (2, 4, 3), (1, 2, 1), (4, 3, 2)])
def test_frontier_batch_matches_torch(dev: torch.device, k: int, depth: int, step: int) -> None:
    bsz, pages, page_size = 3, 6, 4
    scratch = (depth - 1) * k
    table = _table(bsz, pages, seed=k + depth)
    base_len = torch.tensor([1, 7, pages * page_size - scratch])
    g = torch.Generator().manual_seed(step)
    scratch_mask = torch.rand(bsz, k, scratch, generator=g) < 0.5
    tokens = torch.randint(0, 100, (bsz, k), generator=g)
    with torch_ops():
        layout = frontier_layout(base_len, scratch, table, page_size=page_size)
        ref = build_frontier_batch(tokens, step, scratch_mask, layout)
    assert layout.prefix is not None
    layout = frontier_layout(base_len.to(dev), scratch, table.to(dev), page_size=page_size)
    assert layout.prefix is None  # the kernel builds the masks
    got = build_frontier_batch(tokens.to(dev), step, scratch_mask.to(dev), layout)
    for name in ("input_ids", "positions", "out_slots", "kv_slots", "attn_mask"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name


def test_catch_up_batch_matches_torch(dev: torch.device) -> None:
    table = _table(3, 5, seed=9)
    tokens = torch.randint(0, 100, (3, 4))
    start = torch.tensor([0, 5, 11])
    qlen = torch.tensor([4, 0, 2])
    with torch_ops():
        ref = build_catch_up_batch(tokens, start, qlen, table, page_size=4)
    got = build_catch_up_batch(tokens.to(dev), start.to(dev), qlen.to(dev), table.to(dev),
                               page_size=4)
    for name in ("positions", "out_slots", "kv_slots", "logits_indices", "causal_start"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name


def test_paging_kernels_refuse_or_sink_bad_inputs(dev: torch.device) -> None:
    table = _table(2, 3, seed=1).to(dev)
    with pytest.raises(ValueError, match="same rows"):
        paging.slots_for_positions(table[:1], torch.zeros(2, 3, dtype=torch.int64, device=dev),
                                   4)
    # positions outside the table map to the sink, never to another page's slot
    pos = torch.tensor([[-1, 0, 11, 12], [-5, 3, 100, 4]], device=dev)
    got = paging.slots_for_positions(table, pos, 4).cpu()
    assert got[0, 0] == 0 and got[0, 3] == 0 and got[1, 0] == 0 and got[1, 2] == 0
    assert got[0, 2] == table[0, 2].item() * 4 + 3
    # a single length broadcasts as in the torch op; a wrong count is refused
    one = paging.kv_slots_through(table, torch.tensor([5], device=dev), 4)
    both = paging.kv_slots_through(table, torch.tensor([5, 5], device=dev), 4)
    assert torch.equal(one, both)
    with pytest.raises(RuntimeError):
        paging.kv_slots_through(table, torch.tensor([5, 5, 5], device=dev), 4)
