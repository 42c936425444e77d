"""Token selection from (grammar-masked) logits: greedy, temperature, top-k, top-p, min-p.

Sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary entry, which is an
exact draw from ``p`` (the exponential-race form of the Gumbel-max trick). Requests with a seed
draw their noise from their own ``torch.Generator``, so their samples do not depend on what else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for ``R`` logits rows (device tensors unless noted).

    Attributes:
        temperature: ``[R]`` float32, 0 marks greedy rows.
        top_k: ``[R]`` int64, 0 disables.
        top_p: ``[R]`` float32, 1 disables.
        min_p: ``[R]`` float32, 0 disables.
        generators: host list, one per request: its generator or None (engine generator).
        rows_per_request: host int, consecutive rows owned by each request (tree size).
        all_greedy / use_top_k / use_top_p / use_min_p: host flags that skip unused work.
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


def filtered_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Softmax of ``logits / T`` after top-k, top-p and min-p filtering, renormalised.

    Args:
        logits: ``[R, V]`` float32 (masked entries are -inf).

    Returns:
        ``[R, V]`` float32 probabilities; greedy rows use T = 1 (they are argmax'ed anyway).
    """
    temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
    if sb.use_top_k or sb.use_top_p:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if sb.use_top_k:
            ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            k = torch.where(sb.top_k > 0, sb.top_k, torch.full_like(sb.top_k, probs.shape[1]))
            keep &= ranks < k.unsqueeze(1)
        if sb.use_top_p:
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            keep &= mass_before < sb.top_p.unsqueeze(1)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_p)
    if sb.use_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * sb.min_p.unsqueeze(1)
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_rows(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Pick one token per row. ``logits``: ``[R, V]`` float32 on the device; returns ``[R]`` int64.

    Greedy rows take the argmax (ties: lowest id, as ``torch.argmax``); other rows draw from
    :func:`filtered_probs`. No host syncs.
    """
    greedy_tokens = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy_tokens
    probs = filtered_probs(logits, sb)
    noise = torch.empty_like(probs)
    n = sb.rows_per_request
    for i, gen in enumerate(sb.generators):
        noise[i * n : (i + 1) * n].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(sb.temperature > 0, sampled, greedy_tokens)
