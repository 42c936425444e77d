"""Scheduler-side state of one request, and the one function that commits tokens to it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from structspec.core import (
    FinishReason,
    RequestOutput,
    SamplingParams,
    SpecMetrics,
    TokenLogprob,
    stop_holdback,
)
from structspec.scheduler.repeat_stop import RepeatDetector

if TYPE_CHECKING:
    from structspec.bad_words import BadWordIds
    from structspec.grammar.backend import GrammarFuture
    from structspec.grammar.matchers import AnyMatcher
    from structspec.grammar.select_backend import AutoFuture
    from structspec.kvcache.prefix_cache import RegisterCursor
    from structspec.models.tokenizer import IncrementalDetokenizer


class ReqStatus(enum.Enum):
    WAITING_GRAMMAR = "waiting_grammar"  # compile in flight
    WAITING = "waiting"  # ready, waiting for KV pages / a prefill slot
    PREFILLING = "prefilling"  # admitted, prompt KV written in chunks, not yet decoding
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """A request inside the scheduler. Host-only; owned by the scheduler thread/process.

    ``seq_len`` counts tokens whose KV is in the cache (while a prompt is prefilled in chunks,
    the prompt positions written so far). After prefill it is the prompt length;
    the last output token is not yet in the cache (it is node 0 of the next verify tree).

    Requests compare by identity (``eq=False``): the scheduler's queue bookkeeping
    (``req in running``, ``running.remove(req)``) is then a pointer compare, where the generated
    ``__eq__`` compared every field, output lists included, of every request it passed.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_new_tokens: int  # params.max_tokens capped by the context length
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    grammar_future: GrammarFuture | AutoFuture | None = None
    matcher: AnyMatcher | None = None
    # the seed of its sampling draws: ``params.seed``, or one drawn by the scheduler from the
    # engine seed (layers/keyed_sampling.py: output position p is drawn with (seed, p))
    sampling_seed: int = 0
    # the backend that compiled the request's grammar ("xgrammar" / "llguidance"), once known
    grammar_backend: str | None = None
    pages: list[int] = field(default_factory=list)
    # the request's row of the scheduler's HostPageTable while it holds pages
    page_row: int | None = None
    # where its prefix-cache registration stopped (the next chunk resumes there; reset with
    # its pages)
    cache_cursor: RegisterCursor | None = None
    seq_len: int = 0
    # leading prompt tokens whose KV came from the prefix cache (set at admission)
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_param: str | None = None
    error_code: str | None = None
    text: str = ""
    # output ids the host matcher has accepted (the rest wait for the grammar barrier, or
    # were advanced by a mask worker's mirror matcher and are replayed only if needed)
    num_grammar_advanced: int = 0
    num_detokenized: int = 0  # output ids already passed to the detokenizer (or left out)
    num_reported_ids: int = 0  # output ids already returned in a RequestOutput
    num_reported_chars: int = 0  # characters of ``text`` already returned
    logprobs: list[TokenLogprob] | None = None
    # prompt positions scored so far (SamplingParams.prompt_logprobs; position 0 is None),
    # filled chunk by chunk in the prefill (scheduler/prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    first_token_time: float | None = None
    finish_time: float | None = None
    schema_valid: bool | None = None
    drafter_state: Any = None  # owned by the drafter (e.g. n-gram index)
    # row of the device penalty table (scheduler/penalty_slots.py); 0: no penalties
    penalty_slot: int = 0
    # admission and preemption order (lower = served first, vLLM's ``priority``); FCFS at 0
    priority: int = 0
    # its tokenized ``bad_words`` (structspec/bad_words.py; None: none), set by the engine
    bad_words: BadWordIds | None = None
    # arrival number given by ``Scheduler.add`` (FCFS among equal priorities)
    arrival_seq: int = 0
    # preempted and waiting: its KV (prompt + committed output) is rebuilt before it runs
    # again (scheduler/preemption.py); its output, grammar and stop state are kept
    preempted: bool = False
    # times this request was preempted
    num_preemptions: int = 0
    # the repetition stop's detector over the committed output (None: no repetition stop)
    repeat_detector: RepeatDetector | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.params.repetition_stop is not None:
            self.repeat_detector = RepeatDetector(self.params.repetition_stop)

    @property
    def has_penalties(self) -> bool:
        """Whether the request needs a row of the penalty table: a penalty, a logit bias,
        ``allowed_token_ids`` or a one-token bad word (banned there)."""
        return self.params.has_penalties or bool(self.bad_words and self.bad_words.single)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def finish(self, reason: FinishReason, *, force: bool = False,
               stop_reason: str | int | None = None, error: str | None = None,
               error_param: str | None = None, error_code: str | None = None) -> None:
        """Mark finished. The first reason wins unless ``force`` (a stop string found later in
        the same run, or a grammar error, overrides a token-level stop)."""
        if self.finished and not force:
            return
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.error_param = error_param
        self.error_code = error_code

    @property
    def has_unreported(self) -> bool:
        return self.num_reported_ids < self.num_detokenized or self.finished

    def take_output(self, now_s: float) -> RequestOutput:
        """Snapshot for the caller; consumes the streamed delta (ids and text since the last
        output). While running, text that could be the start of a stop string is held back
        (:func:`~structspec.core.stop_holdback`)."""
        ids_end = min(self.num_detokenized, len(self.output_ids))
        text_end = len(self.text)
        if not self.finished:
            text_end = max(self.num_reported_chars, text_end - stop_holdback(self.params))
        new_ids = self.output_ids[self.num_reported_ids:ids_end]
        new_text = self.text[self.num_reported_chars:text_end]
        self.num_reported_ids, self.num_reported_chars = ids_end, text_end
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.output_ids[:ids_end],  # a slice is a new list already
            text=self.text[:text_end],
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            error_param=self.error_param,
            error_code=self.error_code,
            stop_reason=self.stop_reason,
            new_text=new_text,
            new_token_ids=new_ids,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            schema_valid=self.schema_valid,
            grammar_backend=self.grammar_backend,
            cached_tokens=self.num_cached_tokens,
            spec=self.spec,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            # once every position is scored: the list is never changed after that
            prompt_logprobs=(self.prompt_logprobs if self.prompt_logprobs is not None
                             and len(self.prompt_logprobs) == len(self.prompt_ids) else None),
        )
        return out
