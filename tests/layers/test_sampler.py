"""Sampler: filters, and the keyed draw against exact probabilities."""

from __future__ import annotations

import torch

from structspec.layers.sampler import SamplingBatch, filtered_probs, sample_rows


def _sb(rows: int, *, t: float, k: int = 0, p: float = 1.0, m: float = 0.0,
        seeds: list[int] | None = None, starts: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), t), top_k=torch.full((rows,), k),
        top_p=torch.full((rows,), p), min_p=torch.full((rows,), m),
        rows_per_request=1, all_greedy=t == 0,
        use_top_k=k > 0, use_top_p=p < 1, use_min_p=m > 0, top_k_max=k,
        seeds=torch.tensor(seeds if seeds is not None else [0] * rows, dtype=torch.int64),
        starts=torch.tensor(starts if starts is not None else list(range(rows)),
                            dtype=torch.int64))


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
    for k, p in ((0, 1.0), (3, 1.0), (0, 0.999)):  # no filter, top-k, top-p (each keeps all 4
        # but top-k, which drops the 0.05 token)
        toks = sample_rows(logits, _sb(20000, t=1, k=k, p=p, seeds=[1] * 20000))
        want = probs if k == 0 else torch.tensor([0.6, 0.25, 0.1, 0.0]) / 0.95
        freq = torch.bincount(toks, minlength=4).float() / 20000
        assert (freq - want).abs().max() < 0.015, (k, p, freq)
    a = sample_rows(logits[:5], _sb(5, t=1, seeds=[3] * 5))
    b = sample_rows(logits[:5], _sb(5, t=1, seeds=[3] * 5))
    assert a.tolist() == b.tolist()


def test_greedy_rows_take_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    assert sample_rows(logits, _sb(2, t=0)).tolist() == [1, 0]
