"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) scored from a prefill's hidden states.

A prefill normally applies the LM head to each request's last prompt position only. A
request with ``SamplingParams.prompt_logprobs`` also needs, for every computed position
``p``, the log-softmax of the logits there evaluated at the prompt token ``p + 1`` (which
position ``p`` predicts), its rank and the top-k. The full ``[rows, vocab]`` float32 logits
of a long prompt are large (8,192 positions x 49,152 tokens = 1.6 GB), so the LM head runs
over slices of at most :data:`MAX_SCORED_ROWS` rows, and only the small per-row results
(``[rows]`` and ``[rows, k]``) are kept and copied to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MAX_SCORED_ROWS = 256
"""Rows of one LM-head slice: ``256 x 49,152`` float32 logits are 50 MB (twice that with the
log-softmax), bounded whatever the prompt's length."""


@dataclass(frozen=True)
class PromptLogprobsSpec:
    """What one request's prefill chunk scores.

    Attributes:
        top_k: alternatives listed per position (``SamplingParams.prompt_logprobs``).
        target_ids: the prompt token each computed row predicts, in row order: row ``j``
            (position ``start + j``) predicts ``target_ids[j]`` (the prompt token at position
            ``start + j + 1``). Shorter than the chunk by one on the prompt's last chunk,
            whose last row predicts the first generated token, not a prompt token; empty
            when nothing is scored.
    """

    top_k: int
    target_ids: Sequence[int]


@dataclass
class PromptLogprobRows:
    """Scores of ``n`` prompt positions of one request (host or device tensors).

    Attributes:
        logprobs: ``[n]`` float32 logprob of each target token.
        ranks: ``[n]`` int64 1-based rank of each target token (1 + tokens with a strictly
            larger logprob).
        top_ids: ``[n, k]`` int64 most likely token ids, most likely first.
        top_logprobs: ``[n, k]`` float32 their logprobs.
    """

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self) -> PromptLogprobRows:
        """The same rows on the host: one blocking copy (it waits for the forward that made
        them), the four tensors packed as float64 columns (ids and ranks below 2**53 are
        exact there) rather than four copies, each a wait."""
        n, k = self.top_ids.shape
        packed = torch.cat([self.logprobs.double().unsqueeze(1),
                            self.ranks.double().unsqueeze(1), self.top_ids.double(),
                            self.top_logprobs.double()], dim=1).cpu()
        lp, rank, ids, vals = packed.split([1, 1, k, k], dim=1)
        return PromptLogprobRows(lp.reshape(n).float(), rank.reshape(n).long(), ids.long(),
                                 vals.float())


def score_prompt_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                      hidden_rows: torch.Tensor, target_ids: torch.Tensor, top_k: int,
                      max_rows: int = MAX_SCORED_ROWS) -> PromptLogprobRows:
    """Score ``n`` prompt positions: LM head, log-softmax, the target's logprob and rank, and
    the top-k, over slices of at most ``max_rows`` rows.

    Args:
        compute_logits: the model's LM head, ``[R, H]`` model dtype -> ``[R, V]`` float32
            logits, same device (``model.compute_logits``).
        hidden_rows: ``[n, H]`` final hidden states (model dtype, model device), row ``j``
            the position that predicts ``target_ids[j]``.
        target_ids: ``[n]`` int64 target tokens, same device.
        top_k: alternatives per row (0: none; ``[n, 0]`` tensors).
        max_rows: rows per LM-head slice (``>= 1``).

    Returns:
        Device tensors (nothing waits for the device here).

    Raises:
        ValueError: ``hidden_rows`` and ``target_ids`` disagree on ``n``, or ``max_rows < 1``.
    """
    n = hidden_rows.shape[0]
    if target_ids.shape != (n,):
        raise ValueError(f"target_ids has shape {tuple(target_ids.shape)}, expected ({n},)")
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: expected >= 1")
    parts: list[tuple[torch.Tensor, ...]] = []
    for lo in range(0, n, max_rows):
        logp = compute_logits(hidden_rows[lo:lo + max_rows]).float().log_softmax(dim=-1)
        tgt = target_ids[lo:lo + max_rows].unsqueeze(1)
        chosen = logp.gather(1, tgt)  # [r, 1]
        # vLLM's rank: how many tokens are strictly more likely, plus one
        ranks = (logp > chosen).sum(dim=1) + 1
        top = logp.topk(top_k, dim=1) if top_k > 0 else None
        parts.append((chosen.squeeze(1), ranks,
                      top.indices if top is not None else tgt.new_empty((tgt.shape[0], 0)),
                      top.values if top is not None else logp.new_empty((tgt.shape[0], 0))))
        del logp  # the slice's [r, V] logits go before the next slice's
    if not parts:
        dev = hidden_rows.device
        return PromptLogprobRows(
            torch.empty(0, dtype=torch.float32, device=dev),
            torch.empty(0, dtype=torch.int64, device=dev),
            torch.empty((0, top_k), dtype=torch.int64, device=dev),
            torch.empty((0, top_k), dtype=torch.float32, device=dev))
    cols = list(zip(*parts, strict=True))
    return PromptLogprobRows(*(torch.cat(c) for c in cols))
