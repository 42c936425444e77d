"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): which positions each prefill chunk
scores, and the results folded into ``Req.prompt_logprobs``.

A chunk computes prompt positions ``start..end-1``; the hidden state at position ``p``
predicts the prompt token at ``p + 1``, so the chunk scores positions ``start + 1 ..
min(end, L - 1)`` (``L`` the prompt's length): the first token of the next chunk comes from
this chunk's last row, and the prompt's last row predicts the first generated token, which
is no prompt position. Position 0 has no predictor (``None``). A request asking for prompt
logprobs computes its whole prompt (it never reuses prefix-cached KV,
:func:`reuses_prefix_cache`), so its chunks cover positions ``1..L-1`` exactly once, in
order. A preempted request's resume prefill scores nothing (its prompt was scored before it
ever decoded), so nothing is duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from structspec.core import TokenLogprob
from structspec.runner.model_runner import PrefillOutput
from structspec.runner.prompt_logprobs import PromptLogprobsSpec
from structspec.scheduler.request import Req


class PromptSpan(Protocol):
    """Prompt positions ``start..end-1`` of ``req`` computed by one prefill forward (a
    :class:`~structspec.scheduler.chunked_prefill.PrefillChunk`)."""

    @property
    def req(self) -> Req: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


def reuses_prefix_cache(req: Req) -> bool:
    """Whether ``req``'s admission may reuse prefix-cached KV: not with prompt logprobs, whose
    cached positions would never be computed (vLLM bypasses the cache for them too). Its own
    prompt pages are still registered for later requests."""
    return req.params.prompt_logprobs is None


def chunk_specs(chunks: Sequence[PromptSpan]) -> list[PromptLogprobsSpec | None] | None:
    """Per chunk, the prompt tokens its rows score (module doc), or None for a request
    without prompt logprobs; None when no chunk has any (the runner's fast paths stay)."""
    if all(c.req.params.prompt_logprobs is None for c in chunks):
        return None
    specs: list[PromptLogprobsSpec | None] = []
    for c in chunks:
        k = c.req.params.prompt_logprobs
        ids = c.req.prompt_ids
        specs.append(None if k is None else PromptLogprobsSpec(
            top_k=k, target_ids=ids[c.start + 1:min(c.end + 1, len(ids))]))
    return specs


def record_prompt_logprobs(chunks: Sequence[PromptSpan], out: PrefillOutput) -> None:
    """Append each scored chunk's positions to its request's ``prompt_logprobs`` (a copy to
    the host: waits for the prefill forward).

    Raises:
        AssertionError: a chunk does not continue right after the positions its request
            holds (a gap or a repeat), or the forward returned no scores for it.
    """
    for i, c in enumerate(chunks):
        req = c.req
        if req.params.prompt_logprobs is None:
            continue
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]  # position 0: nothing predicts it
        assert len(req.prompt_logprobs) == c.start + 1, (
            f"{req.request_id}: chunk from {c.start} after {len(req.prompt_logprobs)} "
            f"scored positions")
        scored = None if out.prompt_logprobs is None else out.prompt_logprobs[i]
        assert scored is not None, f"{req.request_id}: the prefill scored no prompt positions"
        rows = scored.to_host()
        targets = req.prompt_ids[c.start + 1:c.start + 1 + rows.logprobs.shape[0]]
        for tok, lp, rank, ids, vals in zip(targets, rows.logprobs.tolist(),
                                            rows.ranks.tolist(), rows.top_ids.tolist(),
                                            rows.top_logprobs.tolist(), strict=True):
            req.prompt_logprobs.append(TokenLogprob(
                token_id=tok, logprob=lp, rank=rank,
                top_logprobs=list(zip(ids, vals, strict=True))))
