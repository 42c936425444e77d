"""Token selection from (grammar-masked) logits: greedy, temperature, top-k, top-p, min-p.

Every sampled row is drawn by its request's sampling seed and output position
(:mod:`~structspec.layers.keyed_sampling`: the inverse CDF, in vocabulary order, with a uniform
keyed by ``(seed, position)``), so a request's tokens depend neither on the rest of the batch
nor on its draft trees' sizes, nor on whether it speculates at all; they are an exact draw from
the filtered distribution at each position.
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
        rows_per_request: host int, consecutive rows owned by each request (tree size).
        all_greedy / use_top_k / use_top_p / use_min_p: host flags that skip unused work.
        top_k_max: host int, the largest ``top_k`` when every row sets one, else 0.
        seeds: int64 ``[R]`` each row's request's sampling seed (``Req.sampling_seed``).
        starts: int64 ``[R]`` each row's request's output length before the step: node 0
            samples output position ``start``, a node at depth ``d`` position ``start + d``.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    rows_per_request: int
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    seeds: torch.Tensor
    starts: torch.Tensor
    top_k_max: int = 0


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
    :func:`candidate_probs` by the inverse CDF in vocabulary order with the uniform of
    ``(seed, output position)`` (:func:`~structspec.layers.keyed_sampling.keyed_uniform`; the
    rows of one depth of a tree share it).

    Args:
        logits: ``[R, V]`` float32 on the device.
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
    else:
        # candidates back to vocabulary order: the draw must not depend on how near-equal
        # probabilities were sorted (keyed_sampling's module doc)
        probs = filtered_probs(logits, sb)
    positions = sb.starts if depth is None else sb.starts + depth.reshape(-1)
    sampled = inverse_cdf_sample(probs, keyed_uniform(sb.seeds, positions))
    return torch.where(sb.temperature > 0, sampled, greedy_tokens)
