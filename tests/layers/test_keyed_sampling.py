"""Sampling keyed by (seed, output position): the hash against a plain-Python lowbias32, the
uniforms' spread, the inverse-CDF draw against exact probabilities, and the sampler's seeded
rows (same position -> same token, whatever the tree around it)."""

from __future__ import annotations

import math

import torch

from structspec.layers.keyed_sampling import _lowbias32, inverse_cdf_sample, keyed_uniform
from structspec.layers.sampler import SamplingBatch, sample_rows


def _lowbias32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_lowbias32_matches_the_reference_on_the_whole_range() -> None:
    xs = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]),
                    torch.randint(0, 2**32, (4000,), generator=torch.Generator().manual_seed(0))])
    assert _lowbias32(xs).tolist() == [_lowbias32_reference(int(v)) for v in xs]


def test_keyed_uniforms_are_a_function_of_the_pair_and_spread_evenly() -> None:
    seeds = torch.tensor([0, 1, 2**63 - 1, 2**32, 2**32 + 1], dtype=torch.int64)
    pos = torch.tensor([0, 0, 7, 7, 7], dtype=torch.int64)
    u = keyed_uniform(seeds, pos)
    assert torch.equal(u, keyed_uniform(seeds.flip(0), pos.flip(0)).flip(0))  # no batch effect
    assert len(set(u.tolist())) == 5  # seeds differing only in the high half differ too
    n = 200_000
    for seed in (0, 12345, 2**62 + 3):
        v = keyed_uniform(torch.full((n,), seed, dtype=torch.int64), torch.arange(n))
        assert 0 < v.min() and v.max() < 1
        # Kolmogorov-Smirnov against U(0, 1): the 1e-4 critical value is ~1.95 / sqrt(n)
        ks = (torch.sort(v).values - torch.arange(1, n + 1) / n).abs().max().item()
        assert ks < 1.95 / math.sqrt(n), ks
        # consecutive positions are not correlated
        corr = torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1].item()
        assert abs(corr) < 0.01, corr


def test_inverse_cdf_draw_follows_the_distribution_and_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    u = keyed_uniform(torch.full((n,), 9, dtype=torch.int64), torch.arange(n))
    toks = inverse_cdf_sample(probs.expand(n, -1), u)
    freq = torch.bincount(toks, minlength=7).double() / n
    assert freq[probs == 0].sum() == 0
    assert (freq - probs.double()).abs().max() < 0.01
    # an unnormalised row draws the same as its normalised form
    assert torch.equal(inverse_cdf_sample(3 * probs.expand(n, -1), u), toks)
    # the extremes of u land on the first and the last token of positive mass
    edge = inverse_cdf_sample(probs.expand(2, -1), torch.tensor([1e-7, 1 - 1e-7]))
    assert edge.tolist() == [1, 5]


def _keyed_batch(rows_per_request: int, seeds: list[int], starts: list[int], *,
                 t: float = 0.9, k: int = 0) -> SamplingBatch:
    n, r = rows_per_request, len(seeds) * rows_per_request
    return SamplingBatch(
        temperature=torch.full((r,), t), top_k=torch.full((r,), k, dtype=torch.int64),
        top_p=torch.ones(r), min_p=torch.zeros(r),
        rows_per_request=n, all_greedy=False, use_top_k=k > 0, use_top_p=False,
        use_min_p=False, top_k_max=k,
        seeds=torch.tensor(seeds, dtype=torch.int64).repeat_interleave(n),
        starts=torch.tensor(starts, dtype=torch.int64).repeat_interleave(n))


def test_a_keyed_row_draws_by_output_position_whatever_the_tree() -> None:
    """The row of a node at depth d of a step starting at output length L draws what a
    one-row decode at position L + d draws (same distribution), in any tree and batch."""
    vocab = 50
    g = torch.Generator().manual_seed(1)
    dist = torch.randn(4, vocab, generator=g)  # the distribution at positions 10..13
    for k in (0, 7):  # no filter (probs over the vocabulary) and top-k (sorted candidates)
        decode = [sample_rows(dist[p: p + 1], _keyed_batch(1, [42], [10 + p], k=k)).item()
                  for p in range(4)]
        # a 6-node tree (depths 0,1,1,2,3,2) starting at L = 10, next to another request
        depth = torch.tensor([[0, 1, 1, 2, 3, 2], [0, 1, 2, 3, 4, 5]])
        rows = torch.cat([dist[depth[0]], torch.randn(6, vocab, generator=g)])
        tree = sample_rows(rows, _keyed_batch(6, [42, 9], [10, 3], k=k), depth)
        assert [tree[j].item() for j in range(6)] == [decode[d] for d in depth[0].tolist()]
        # the draws are random: other seeds draw other tokens at one position
        many = {sample_rows(dist[:1], _keyed_batch(1, [s], [10], k=k)).item()
                for s in range(40)}
        assert len(many) > 1
        # a greedy row of the batch keeps its argmax
        mixed = _keyed_batch(1, [42, 42], [10, 10], k=k)
        mixed.temperature[1] = 0.0
        got = sample_rows(dist[:2], mixed)
        assert got[1].item() == dist[1].argmax().item()
