"""Per-token log-probabilities of committed runs (OpenAI ``logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structspec.core import TokenLogprob
from structspec.scheduler.request import Req


def record_logprobs(reqs: Sequence[Req], logits: torch.Tensor, accept_nodes: torch.Tensor,
                    runs: list[list[int]]) -> None:
    """Append the target log-probabilities of each run's tokens to ``req.logprobs``: after
    the grammar mask, before temperature and filtering (what OpenAI's ``logprobs`` reports).

    Args:
        reqs: the step's requests (only those with ``params.logprobs`` set are recorded).
        logits: ``[B, N, V]`` float32 masked logits (device).
        accept_nodes: ``[B, N]`` int64 accepted node per depth (device).
        runs: each request's committed run (host ints), as the step's wait returned them.
    """
    nodes_cpu = accept_nodes.cpu()
    for b, req in enumerate(reqs):
        k = req.params.logprobs
        if k is None:
            continue
        rows = logits[b, nodes_cpu[b, : len(runs[b])]].float().log_softmax(dim=-1).cpu()
        if req.logprobs is None:
            req.logprobs = []
        for row, tok in zip(rows, runs[b], strict=True):
            top = row.topk(k) if k > 0 else None
            # Tokens the grammar forbids (-inf) are never listed, as in the server.
            req.logprobs.append(TokenLogprob(
                token_id=tok, logprob=float(row[tok]),
                top_logprobs=[] if top is None else [
                    (t, v) for t, v in zip(top.indices.tolist(), top.values.tolist(),
                                           strict=True) if v != float("-inf")],
            ))


def trim_logprobs(req: Req) -> None:
    """Drop logprobs recorded for tokens that a stop cut from the run."""
    if req.logprobs is not None and len(req.logprobs) > len(req.output_ids):
        del req.logprobs[len(req.output_ids):]
