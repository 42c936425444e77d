"""Chunked prefill: a long prompt is prefilled over several steps, between the verify steps
of the requests already decoding, so that its prefill does not freeze their streams.

The unit of work is a :class:`PrefillChunk`: prompt positions ``start..end-1`` of one request,
computed over the KV of positions ``0..start-1`` already in its pages - exactly the prefill
over cached KV of prefix caching (``ModelRunner.prefill(..., num_cached)``), whose cached
prefix is here the request's own earlier chunks. A prefill step runs a batch of chunks (one
padded forward); a request whose last chunk is in (``end == len(prompt)``) is then complete
and only then gets its first token: the logits of its last prompt position, its grammar mask,
the selection and the commit, as before chunking. Until then nothing of it is sampled, its
grammar matcher is not touched and it is no part of a verify step.

Policy (``SchedulerConfig.enable_chunked_prefill``, ``max_num_batched_tokens``):

* **Budget.** One prefill step computes at most ``max_num_batched_tokens`` query rows,
  counted as the forward computes them: requests x the longest chunk (padding included).
  Only the step's first request may get a partial chunk (a long prompt progresses a budget
  at a time); every later one must fit whole, so at most one request is part-way through its
  prompt at any time, and it comes first in the next prefill step (first come, first served).
* **Chunks ride with verify steps.** While requests decode, every step launches its chunks
  first, then the running requests' verify forward queued behind them on the same stream:
  one step, one output collection. A running stream thus waits one chunk's device time per
  token, not a separate prefill step's host time plus it (with alternating prefill and
  verify steps, the H200's streams waited a verify step plus a prefill step, 4-6 ms, per
  token beside a 7,000-token prompt; benchmarks/README.md "Chunked prefill"). With nothing
  decoding, prefill steps run back to back. Without chunking a prefill step stays a step of
  its own (whole prompts).

Drafters across chunks: EAGLE gets the target features of each chunk's positions after its
forward (``Drafter.on_target_hidden`` with ``seq_len = start``, in position order, so its
features have no gap; a first chunk over prefix-cached KV hands the cached positions' features
from the runner's store as well). The draft model and the n-gram drafter only see the request
once it decodes (their catch-up covers the whole history). Prefix caching: after each chunk
the prompt's full pages written so far are registered (final, never written again).

With chunking off the same step runs each admitted prompt whole (one chunk per request),
under ``SchedulerConfig.max_prefill_tokens``, as the scheduler always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from structspec.config import SchedulerConfig
from structspec.runner.model_runner import ModelRunner, PrefillOutput
from structspec.scheduler.draft_guard import GuardedDrafter
from structspec.scheduler.prompt_logprobs import chunk_specs
from structspec.scheduler.request import Req, ReqStatus
from structspec.speculative.base import DraftRequest


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions ``start..end-1`` of ``req``, computed over the KV of ``0..start-1``.

    Attributes:
        req: the request.
        start: first prompt position computed (its pages hold the KV before it: prefix-cached
            pages and the request's own earlier chunks).
        end: one past the last position computed (``<= len(req.prompt_ids)``).
        first: the request's first chunk (``start`` = its prefix-cache hit).
    """

    req: Req
    start: int
    end: int
    first: bool

    @property
    def last(self) -> bool:
        """The prompt is complete after this chunk: its logits give the first token."""
        return self.end == len(self.req.prompt_ids)


class PrefillBudget(Protocol):
    """How many prompt tokens the next request of a prefill step may compute."""

    def grant(self, num_tokens: int) -> int:
        """Tokens the next request may compute of the ``num_tokens`` it has left (0: the step
        is full). Nothing is taken until :meth:`take`."""

    def take(self, num_tokens: int) -> None:
        """The next request computes ``num_tokens`` (a value :meth:`grant` returned)."""


class WholePromptBudget:
    """Chunking off: whole prompts, ``max_tokens`` in all per step (the first always fits).

    Attributes:
        grants: tokens each admitted request computes, in order.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.grants: list[int] = []

    def grant(self, num_tokens: int) -> int:
        if self.grants and sum(self.grants) + num_tokens > self.max_tokens:
            return 0
        return num_tokens

    def take(self, num_tokens: int) -> None:
        self.grants.append(num_tokens)


class ChunkBudget:
    """Chunking on: ``rows x longest chunk <= budget`` query rows; only the first request of
    the step may get a partial chunk.

    Attributes:
        grants: tokens each request of the step computes, in order.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.grants: list[int] = []
        self._longest = 0

    def grant(self, num_tokens: int) -> int:
        if not self.grants:
            return min(num_tokens, self.budget)
        rows = len(self.grants) + 1
        return num_tokens if rows * max(self._longest, num_tokens) <= self.budget else 0

    def take(self, num_tokens: int) -> None:
        self.grants.append(num_tokens)
        self._longest = max(self._longest, num_tokens)


class ChunkedPrefill:
    """The scheduler's prefill policy: which chunks a step runs, and the request part-way
    through its prompt (see the module doc).

    Args:
        config: the resolved scheduler config (``enable_chunked_prefill``,
            ``max_num_batched_tokens``, ``max_prefill_tokens``).

    Attributes:
        prefilling: admitted requests whose prompt KV is partly written (status
            ``PREFILLING``; at most one), first come first served.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.enabled = config.enable_chunked_prefill
        budget = config.max_num_batched_tokens
        if self.enabled and budget is None:
            raise ValueError("max_num_batched_tokens is unresolved (call "
                             "resolve_engine_config first)")
        self.budget_tokens = budget or 0
        self.max_prefill_tokens = config.max_prefill_tokens
        self.prefilling: list[Req] = []

    def budget(self) -> WholePromptBudget | ChunkBudget:
        """A fresh budget for one prefill step."""
        if self.enabled:
            return ChunkBudget(self.budget_tokens)
        return WholePromptBudget(self.max_prefill_tokens)

    def continue_prefills(self, budget: PrefillBudget) -> list[PrefillChunk]:
        """The next chunks of the requests part-way through their prompts (taken from
        ``budget`` first: they arrived before anything still waiting)."""
        chunks = []
        for req in self.prefilling:
            take = budget.grant(len(req.prompt_ids) - req.seq_len)
            if not take:
                break
            budget.take(take)
            chunks.append(PrefillChunk(req, req.seq_len, req.seq_len + take, first=False))
        return chunks

    def plan(self, continued: list[PrefillChunk], admitted: Sequence[Req],
             budget: WholePromptBudget | ChunkBudget) -> list[PrefillChunk]:
        """This step's chunks: ``continued``, then the first chunk of each newly ``admitted``
        request (whose grants follow the continued ones' in ``budget.grants``)."""
        chunks = list(continued)
        grants = budget.grants[len(continued):]
        for req, take in zip(admitted, grants, strict=False):
            start = req.num_cached_tokens
            chunks.append(PrefillChunk(req, start, start + take, first=True))
        return chunks

    def after_forward(self, chunks: Sequence[PrefillChunk]) -> list[Req]:
        """Advance each request's written length; those whose prompt is not complete wait
        for their next chunk (``PREFILLING``). Returns the complete ones, in order."""
        done = []
        for c in chunks:
            c.req.seq_len = c.end
            if c.last:
                c.req.status = ReqStatus.RUNNING
                if c.req in self.prefilling:
                    self.prefilling.remove(c.req)
                done.append(c.req)
            else:
                c.req.status = ReqStatus.PREFILLING
                if c.req not in self.prefilling:
                    self.prefilling.append(c.req)
        return done

    def discard(self, req: Req) -> None:
        """Forget a request that ends before its prompt is complete (aborted)."""
        if req in self.prefilling:
            self.prefilling.remove(req)


def prefill_forward(runner: ModelRunner, chunks: Sequence[PrefillChunk], *,
                    feeds_hidden: bool) -> PrefillOutput:
    """One target forward over ``chunks`` (KV written; on CUDA launched, not waited on).

    The runner gathers every prompt position's features from its store only when a first
    chunk starts over prefix-cached KV (their drafter needs the cached positions' too).
    ``feeds_hidden``: the drafter reads target features; without it only the logits are
    read, so the runner may replay a prefill graph (``ModelRunner.prefill(logits_only=)``).
    A chunk of a request with prompt logprobs has its positions scored
    (:mod:`structspec.scheduler.prompt_logprobs`; the step then runs eagerly).
    """
    starts = [c.start for c in chunks]
    return runner.prefill(
        [c.req.prompt_ids[:c.end] for c in chunks], [c.req.pages for c in chunks],
        starts if any(starts) else None,
        gather_prompt_features=any(c.first and c.start > 0 for c in chunks),
        logits_only=not feeds_hidden, prompt_logprobs=chunk_specs(chunks))


@dataclass(frozen=True)
class FeatureSpan:
    """What one request's prefill hands a feature-reading drafter.

    Attributes:
        request_id: the request.
        token_ids: its sequence (prompt, or prompt + output on a resume).
        start: first position this prefill computed.
        end: one past the last position computed.
        cached: leading positions whose KV came from the prefix cache in this prefill (their
            features only exist in the runner's feature store).
    """

    request_id: str
    token_ids: list[int]
    start: int
    end: int
    cached: int


def feed_target_features(draft: GuardedDrafter, spans: Sequence[FeatureSpan],
                         out: PrefillOutput) -> None:
    """Hand a feature-reading drafter (EAGLE) the target features of each span's positions,
    in position order (``on_target_hidden``).

    Raises:
        AssertionError: a span reused cached KV but the runner keeps no feature store.
    """
    if out.prompt_hidden_states is not None and out.prompt_aux_hidden_states is not None:
        # positions 0..end-1 of every request (the cached ones included); a request past its
        # first chunk stores its earlier positions again, with the same values
        draft.on_target_hidden(
            [DraftRequest(s.request_id, s.token_ids, 0) for s in spans],
            out.prompt_hidden_states, None, [s.end for s in spans],
            out.prompt_aux_hidden_states)
        return
    assert not any(s.cached for s in spans), "prefix reuse for a drafter without prompt features"
    # row j of request b is position spans[b].start + j
    draft.on_target_hidden(
        [DraftRequest(s.request_id, s.token_ids, s.start) for s in spans],
        out.hidden_states, None, [s.end - s.start for s in spans], out.aux_hidden_states)


def feed_prompt_features(draft: GuardedDrafter, chunks: Sequence[PrefillChunk],
                         out: PrefillOutput) -> None:
    """:func:`feed_target_features` for a prefill step's chunks (a first chunk's start is its
    prefix-cache hit)."""
    feed_target_features(draft, [
        FeatureSpan(c.req.request_id, c.req.prompt_ids, c.start, c.end,
                    c.start if c.first else 0) for c in chunks], out)
