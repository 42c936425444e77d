"""``ForwardBatch.causal_start``: every builder that sets it builds a mask that is exactly the
causal rule on its real rows, which is what the Triton backend's mask-free causal kernel
applies instead of reading the mask (structspec/kernels/attention.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structspec.layers.forward_batch import ForwardBatch
from structspec.runner.batch_builder import build_prefill_batch, build_verify_batch_from_tensors
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
    cols = torch.arange(fb.attn_mask.shape[2])
    for b, rows in enumerate(real_rows):
        start = int(fb.causal_start[b])
        for q in range(rows):
            assert int(fb.positions[b, q]) == start + q
            assert torch.equal(fb.attn_mask[b, q], cols <= start + q), (b, q)


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
    """The prefill graphs' batch: a chain tree over ``start`` cached positions, with
    ``causal_start = start`` (structspec/runner/prefill_graph.py)."""
    n, start = 6, 9
    table = torch.tensor([_pages([start + n])[0]])
    fb = build_verify_batch_from_tensors(
        torch.arange(1, n + 1).view(1, n), torch.arange(n).view(1, n),
        torch.ones(n, n, dtype=torch.bool).tril().view(1, n, n), torch.tensor([start]), table,
        page_size=PAGE)
    fb.causal_start = torch.tensor([start])
    assert_causal_rule(fb, [n])
