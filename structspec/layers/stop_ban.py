"""``min_tokens``: no stop token before a request's first ``min_tokens`` output tokens, exact
per verify-tree row.

vLLM's ``min_tokens`` sets the logits of the request's stop tokens (EOS unless
``ignore_eos``, and its ``stop_token_ids``) to -inf while its output is shorter than
``min_tokens``. Under speculation each row of a verify tree predicts one output position (the
request's output length before the step plus the node's depth), so the ban holds for the rows
whose position is below ``min_tokens`` and for no other: greedy output with speculation stays
equal to greedy output without it, and sampling stays exact.

A grammar goes first: a row whose grammar mask allows nothing but stop tokens (the structure
is complete) keeps them, so the request ends there, shorter than ``min_tokens``, instead of
having no token to choose (vLLM's processor would leave such a row all -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StopBan:
    """The requests of a batch whose stop tokens are banned at some rows this step.

    Attributes:
        requests: int64 ``[M]`` batch indices of the requests, on the model device.
        until: int64 ``[M]`` ``min_tokens - len(output)`` of each: its rows at a node depth
            below this are banned.
        tokens: int64 ``[M, T]`` each request's stop token ids (a shorter list repeats its
            first id to fill the row).
    """

    requests: torch.Tensor
    until: torch.Tensor
    tokens: torch.Tensor


def ban_stop_tokens_(logits: torch.Tensor, depth: torch.Tensor, ban: StopBan) -> None:
    """Set the banned requests' stop-token logits to -inf at the rows below their
    ``min_tokens``, unless that leaves a row nothing to choose. In place; no host sync.

    Args:
        logits: ``[B * N, V]`` float32 on the device, after the grammar mask (row
            ``b * N + i`` = node i of request b).
        depth: int64 ``[B, N]`` each node's depth in its tree, on the device.
        ban: the batch's banned requests (built by the scheduler's selection phase).
    """
    n = depth.shape[1]
    rows = (ban.requests.unsqueeze(1) * n + torch.arange(n, device=logits.device)).view(-1)
    active = (depth.index_select(0, ban.requests) < ban.until.unsqueeze(1)).view(-1, 1)
    before = logits.index_select(0, rows)  # [M * N, V], a copy
    banned = before.scatter(1, ban.tokens.repeat_interleave(n, dim=0), float("-inf"))
    # a row left all -inf (only stop tokens allowed: the grammar is complete) keeps them; a
    # NaN row stays as it was, for select_verify to refuse
    keep = active & torch.isfinite(banned.amax(dim=1, keepdim=True))
    logits.index_copy_(0, rows, torch.where(keep, banned, before))
