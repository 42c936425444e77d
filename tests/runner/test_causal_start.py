"""``ForwardBatch.causal_start``: every builder that sets it lays out a causal chain whose mask
(built on demand by ``ForwardBatch.mask``) is exactly the causal rule on its real rows, which
is what the Triton backend's mask-free causal kernel applies (structspec/kernels/attention.py);
for the prefill graphs' chain, the same mask the tree-verify builder gives a chain tree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structspec.layers.forward_batch import ForwardBatch
from structspec.runner.batch_builder import (
    build_chain_batch,
    build_prefill_batch,
    build_verify_batch_from_tensors,
)
from structspec.speculative.draft_batches import build_extend_batch

PAGE = 4
CPU = torch.device("cpu")


def _pages(lengths: list[int]) -> list[list[int]]:
    pages, nxt = [], 1
    for n in lengths:
        k = -(-n // PAGE)
        pages.append(list(range(nxt, nxt + k)))
        nxt += k
    return pages


def assert_causal_rule(fb: ForwardBatch, real_rows: list[int]) -> None:
    """Rows ``0 .. real_rows[b] - 1`` of request ``b`` allow exactly columns
    ``0 .. causal_start[b] + q``, and their rotary positions are ``causal_start[b] + q``."""
    assert fb.causal_start is not None and fb.causal_start.dtype == torch.int64
    assert fb.causal_start.shape == (fb.batch_size,)
    mask = fb.mask()
    cols = torch.arange(mask.shape[2])
    for b, rows in enumerate(real_rows):
        start = int(fb.causal_start[b])
        for q in range(rows):
            assert int(fb.positions[b, q]) == start + q
            assert torch.equal(mask[b, q], cols <= start + q), (b, q)


@pytest.mark.parametrize("cached", [None, [0, 5, 9]])
def test_prefill_batch(cached: list[int] | None) -> None:
    rng = np.random.default_rng(0)
    lens = [7, 13, 10]
    prompts = [rng.integers(1, 100, n).tolist() for n in lens]
    fb = build_prefill_batch(prompts, _pages(lens), page_size=PAGE, device=CPU,
                             num_cached=cached)
    starts = cached or [0, 0, 0]
    assert fb.causal_start.tolist() == starts
    assert_causal_rule(fb, [n - s for n, s in zip(lens, starts, strict=True)])


def test_extend_batch() -> None:
    starts, new = [0, 6, 11], [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    lens = [s + len(t) for s, t in zip(starts, new, strict=True)]
    pages = _pages(lens)
    width = max(map(len, pages))
    table = torch.zeros(len(pages), width, dtype=torch.int64)
    for b, p in enumerate(pages):
        table[b, : len(p)] = torch.tensor(p)
    fb = build_extend_batch(new, starts, table, page_size=PAGE, device=CPU, staging=None)
    assert fb.causal_start.tolist() == starts
    assert_causal_rule(fb, [len(t) for t in new])


def test_prefill_graph_chain_is_the_causal_rule() -> None:
    """The prefill graphs' batch (``build_chain_batch``): the slots, positions and mask of a
    chain tree over ``start`` cached positions as the verify builder lays it out."""
    n, start = 6, 9
    table = torch.tensor([_pages([start + n])[0]])
    ids = torch.arange(1, n + 1).view(1, n)
    fb = build_chain_batch(ids, torch.tensor([start]), table, page_size=PAGE)
    assert fb.attn_mask is None  # no mask built for the Triton backend's causal kernel
    ref = build_verify_batch_from_tensors(
        ids, torch.arange(n).view(1, n), torch.ones(n, n, dtype=torch.bool).tril().view(1, n, n),
        torch.tensor([start]), table, page_size=PAGE)
    for name in ("input_ids", "positions", "out_slots", "kv_slots"):
        assert torch.equal(getattr(fb, name), getattr(ref, name)), name
    assert torch.equal(fb.mask(), ref.attn_mask)
    assert_causal_rule(fb, [n])


def test_mask_needs_a_mask_or_a_rule() -> None:
    ids = torch.zeros(1, 2, dtype=torch.int64)
    fb = ForwardBatch(ids, ids, ids, torch.zeros(1, 4, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="neither attn_mask nor causal_start"):
        fb.mask()
