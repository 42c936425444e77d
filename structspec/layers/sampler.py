"""Token selection from (grammar-masked) logits: greedy, temperature, top-k, top-p, min-p.

Unseeded sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary entry from
the engine's generator, which is an exact draw from ``p`` (the exponential-race form of the
Gumbel-max trick). A request with a seed draws each output position with a uniform keyed by
``(seed, position)`` (:mod:`~structspec.layers.keyed_sampling`), so its tokens depend neither
on the rest of the batch nor on its draft trees' sizes, nor on whether it speculates at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from structspec.layers.keyed_sampling import inverse_cdf_sample, keyed_uniform


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for ``R`` logits rows (device tensors unless noted).

    Attributes:
        temperature: ``[R]`` float32, 0 marks greedy rows.
        top_k: ``[R]`` int64, 0 disables.
        top_p: ``[R]`` float32, 1 disables.
        min_p: ``[R]`` float32, 0 disables.
        generators: host list, one per request: the generator of its noise; None = a
            seeded request's (its rows are in ``seeded_rows``) when ``seeded_rows`` is set,
            else torch's default generator.
        rows_per_request: host int, consecutive rows owned by each request (tree size).
        all_greedy / use_top_k / use_top_p / use_min_p: host flags that skip unused work.
        top_k_max: host int, the largest ``top_k`` when every row sets one, else 0.
        seeded_rows: int64 ``[Rs]`` the rows of the seeded requests (all ``N`` rows of
            each), or None when no request of the batch has a seed.
        seeded_seeds: int64 ``[Rs]`` each of those rows' seed.
        seeded_starts: int64 ``[Rs]`` each of those rows' request's output length before the
            step (node 0 samples output position ``start``, a node at depth ``d`` position
            ``start + d``).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    rows_per_request: int
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    top_k_max: int = 0
    seeded_rows: torch.Tensor | None = None
    seeded_seeds: torch.Tensor | None = None
    seeded_starts: torch.Tensor | None = None


def _filter_sorted(probs_sorted: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Top-p and min-p on probabilities sorted in descending order, ``[R, K]``; renormalised."""
    if sb.use_top_p:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        probs_sorted = probs_sorted * (mass_before < sb.top_p.unsqueeze(1))
    if sb.use_min_p:
        threshold = probs_sorted[:, :1] * sb.min_p.unsqueeze(1)
        probs_sorted = torch.where(probs_sorted >= threshold, probs_sorted,
                                   torch.zeros_like(probs_sorted))
    return probs_sorted / probs_sorted.sum(dim=-1, keepdim=True)


def candidate_probs(logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered distribution over each row's candidates, largest first.

    Rows keep exactly their ``top_k`` most likely tokens (all tokens when ``top_k`` is 0),
    then top-p and min-p apply. When every row sets ``top_k`` (``sb.top_k_max > 0``) only the
    ``top_k_max`` best tokens are ever materialised, so no full-vocabulary sort or noise runs.

    Args:
        logits: ``[R, V]`` float32 (masked entries are -inf).

    Returns:
        ``(probs [R, K], token_ids [R, K])``, ``K = top_k_max`` or ``V``; greedy rows use T = 1.
    """
    temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    scaled = logits / temp.unsqueeze(1)
    vocab = scaled.shape[1]
    width = min(sb.top_k_max, vocab) if sb.top_k_max > 0 else vocab
    if width < vocab:
        vals, ids = scaled.topk(width, dim=-1)
    else:
        vals, ids = scaled.sort(dim=-1, descending=True)
    if sb.use_top_k:
        k = torch.where(sb.top_k > 0, sb.top_k, torch.full_like(sb.top_k, vocab))
        rank = torch.arange(width, device=scaled.device).unsqueeze(0)
        vals = vals.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    return _filter_sorted(torch.softmax(vals, dim=-1), sb), ids


def filtered_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """:func:`candidate_probs` scattered back to the full vocabulary, ``[R, V]`` float32."""
    probs, ids = candidate_probs(logits, sb)
    return torch.zeros_like(logits).scatter_(1, ids, probs)


def sample_rows(logits: torch.Tensor, sb: SamplingBatch,
                depth: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row. No host syncs.

    Greedy rows take the argmax (ties: lowest id, as ``torch.argmax``). Other rows draw from
    :func:`candidate_probs`: a seeded request's rows by the inverse CDF in vocabulary order
    with the uniform of ``(seed, output position)``
    (:func:`~structspec.layers.keyed_sampling.keyed_uniform`; the rows of one depth share
    it), the others with the exponential race on their generator's noise.

    Args:
        logits: ``[R, V]`` float32 on the device, ``R = len(sb.generators) * N``.
        sb: the rows' sampling parameters.
        depth: int64 ``[R / N, N]`` (or ``[R]``) each row's node depth in its tree, on the
            device; None = every row at depth 0 (one row per request: a prefill or a decode).

    Returns:
        int64 ``[R]`` token ids.
    """
    greedy_tokens = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy_tokens
    if not (sb.use_top_k or sb.use_top_p or sb.use_min_p):
        temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
        ids = None
    else:
        probs, ids = candidate_probs(logits, sb)
    n = sb.rows_per_request
    noise = torch.ones_like(probs) if sb.seeded_rows is not None else torch.empty_like(probs)
    for i, gen in enumerate(sb.generators):
        if gen is not None or sb.seeded_rows is None:  # a seeded request's rows: below
            noise[i * n : (i + 1) * n].exponential_(generator=gen)
    choice = (probs / noise).argmax(dim=-1)
    sampled = choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    if sb.seeded_rows is not None:
        sampled = _redraw_seeded(probs, ids, sampled, sb, depth, logits.shape[1])
    return torch.where(sb.temperature > 0, sampled, greedy_tokens)


def _redraw_seeded(probs: torch.Tensor, ids: torch.Tensor | None, sampled: torch.Tensor,
                   sb: SamplingBatch, depth: torch.Tensor | None, vocab_size: int
                   ) -> torch.Tensor:
    """``sampled`` with the seeded requests' rows drawn by output position (see
    :func:`sample_rows`); ``probs``/``ids`` as :func:`candidate_probs` gave them (``ids`` None:
    ``probs`` is over the whole vocabulary already)."""
    rows, seeds, starts = sb.seeded_rows, sb.seeded_seeds, sb.seeded_starts
    assert rows is not None and seeds is not None and starts is not None
    positions = starts if depth is None else starts + depth.reshape(-1).index_select(0, rows)
    part = probs.index_select(0, rows)
    if ids is not None:  # candidates back to vocabulary order (keyed_sampling's module doc)
        part = torch.zeros(part.shape[0], vocab_size, dtype=part.dtype,
                           device=part.device).scatter_(1, ids.index_select(0, rows), part)
    drawn = inverse_cdf_sample(part, keyed_uniform(seeds, positions))
    return sampled.index_copy(0, rows, drawn)
