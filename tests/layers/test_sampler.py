"""Sampler: filters and the exponential-race draw against exact probabilities."""

from __future__ import annotations

import torch

from structspec.layers.sampler import SamplingBatch, filtered_probs, sample_rows


def _sb(rows: int, *, t: float, k: int = 0, p: float = 1.0, m: float = 0.0,
        gens: list | None = None) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), t), top_k=torch.full((rows,), k),
        top_p=torch.full((rows,), p), min_p=torch.full((rows,), m),
        generators=gens or [None] * rows, rows_per_request=1, all_greedy=t == 0,
        use_top_k=k > 0, use_top_p=p < 1, use_min_p=m > 0, top_k_max=k)


def test_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(filtered_probs(logits, _sb(1, t=1, k=2)), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(filtered_probs(logits, _sb(1, t=1, p=0.7)), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(filtered_probs(logits, _sb(1, t=1, p=0.81)),
                          torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
    assert torch.allclose(filtered_probs(logits, _sb(1, t=1, m=0.5)), torch.tensor([[0.625, 0.375, 0, 0]]))


def test_draws_follow_distribution_and_seed_is_reproducible() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().expand(20000, 4).contiguous()
    g = torch.Generator().manual_seed(1)
    toks = sample_rows(logits, SamplingBatch(
        temperature=torch.ones(20000), top_k=torch.zeros(20000, dtype=torch.int64),
        top_p=torch.ones(20000), min_p=torch.zeros(20000), generators=[g], rows_per_request=20000,
        all_greedy=False, use_top_k=False, use_top_p=False, use_min_p=False))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert (freq - probs).abs().max() < 0.015
    a = sample_rows(logits[:5], _sb(5, t=1, gens=[torch.Generator().manual_seed(3) for _ in range(5)]))
    b = sample_rows(logits[:5], _sb(5, t=1, gens=[torch.Generator().manual_seed(3) for _ in range(5)]))
    assert a.tolist() == b.tolist()


def test_greedy_rows_take_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    assert sample_rows(logits, _sb(2, t=0)).tolist() == [1, 0]
