"""The engine requests behind one HTTP request, and their detokenization.

One HTTP request fans out into ``len(prompts) * n`` engine requests (:class:`ChoiceState`),
all delivering into one ``asyncio.Queue``. :class:`GenerationRun` submits them, applies each
delta as it arrives (detokenizing in this, the front-end, process), records metrics, turns
an early failure into an :class:`~structspec.server.errors.APIError`, and aborts whatever is
still running when the HTTP side goes away.

Stop strings: the engine decides *when* a stop string ends a request; the text here is cut
at the same place (before the stop string, or after it with ``include_stop_str_in_output``).
While streaming, the last ``len(longest stop) - 1`` characters are held back so a stop string
is never partly sent; with ``include_stop_str_in_output`` nothing is held back (what was sent
before the last token stays in the final text: :func:`~structspec.core.stop_holdback`).

Special tokens: each choice's detokenizer drops them unless the request's
``skip_special_tokens`` is false, as the engine's detokenizer does (its stop strings are
matched against the same text). The token that ended a choice at token level (EOS, a
``stop_token_ids`` id) stays out of the text unless ``include_stop_str_in_output``
(:func:`~structspec.core.stop_token_hidden`, the engine's rule too). With special tokens
kept, ``spaces_between_special_tokens`` false is passed to the detokenizer, which applies
vLLM's rule to streamed and whole text alike (the whole text is the streamed pieces).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from structspec.constraints import PARAM_BY_KIND
from structspec.core import SamplingParams, SpecMetrics, stop_holdback, stop_token_hidden
from structspec.server.codec import Codec, Detokenizer
from structspec.server.engine_client import AsyncEngine, EngineDeadError
from structspec.server.errors import APIError, bad_request, server_error, unavailable
from structspec.server.hermes_tools import TOOLS_PARAM, tool_place
from structspec.server.ipc import EngineDelta, PromptLogprobEntry
from structspec.server.metrics import ServerMetrics
from structspec.stop_strings import first_stop_ending_after

logger = logging.getLogger("structspec.server")

LogprobEntry = tuple[int, float, list[tuple[int, float]]]

SHUTDOWN_ERRORS = ("server is shutting down", "engine process exited", "engine crashed")

GRAMMAR_KIND_PARAMS = frozenset(PARAM_BY_KIND.values())
"""The ``param`` values the engine gives grammar errors: one per grammar *kind*. The engine
cannot know which request field the grammar came from; :func:`error_for` replaces these with
the field the server read it from."""

STRUCTURAL_TAG_PARAM = "structural_tag"
"""The kind ``param`` of a structural tag: a place in the tag may follow it
(``structural_tag.structures[0].schema``), which :func:`request_param` keeps."""


def request_param(param: str | None, grammar_param: str | None) -> str | None:
    """The request field an engine error's ``param`` names, with the grammar read from
    ``grammar_param``: a grammar kind's param becomes ``grammar_param``, and a place in a
    structural tag follows it (``structural_tag.structures[0].schema`` from
    ``response_format`` -> ``response_format.structures[0].schema``; for auto tool calls,
    ``grammar_param`` ``tools``, ``tools[0].function.parameters``); another param is kept."""
    if grammar_param is None or param is None:
        return param
    if param in GRAMMAR_KIND_PARAMS:
        return grammar_param
    head = STRUCTURAL_TAG_PARAM
    if param.startswith(head) and param[len(head):len(head) + 1] in (".", "["):
        if grammar_param == TOOLS_PARAM:  # auto tool calls: the place is a tool's parameters
            return tool_place(param[len(head) + 1:])
        return grammar_param + param[len(head):]
    return param


@dataclass
class ChoiceState:
    """One engine request = one ``choices[i]`` of the response."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: Detokenizer
    grammar_param: str | None = None  # the request field the grammar was read from
    text: str = ""
    sent_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    sent_logprobs: int = 0
    # the scored prompt (SamplingParams.prompt_logprobs), once the engine sent it
    prompt_logprobs: list[PromptLogprobEntry | None] | None = None
    prompt_logprobs_sent: bool = False  # streamed already
    final: EngineDelta | None = None
    first_token_s: float | None = None  # front-end clock, since the HTTP request arrived
    finish_sent: bool = False
    recorded: bool = False  # counted in the metrics (finished, or abandoned by the client)
    # a stop string counts only where it ends past this index: the text of the first
    # min_tokens tokens (the engine does not look for stop strings in it)
    stop_search_from: int = 0

    @property
    def finished(self) -> bool:
        return self.final is not None

    @property
    def finish_reason(self) -> str | None:
        return None if self.final is None else self.final.finish_reason

    @property
    def error(self) -> str | None:
        return None if self.final is None else self.final.error

    @property
    def holdback(self) -> int:
        """Characters at the end of :attr:`text` not streamed while running."""
        return stop_holdback(self.params)

    def apply(self, delta: EngineDelta, elapsed_s: float) -> None:
        """Fold one engine delta in (detokenizing its new tokens)."""
        if delta.new_token_ids:
            if self.first_token_s is None:
                self.first_token_s = elapsed_s
            ids = delta.new_token_ids
            if delta.finished and stop_token_hidden(self.params, delta.finish_reason,
                                                    delta.stop_reason):
                ids = ids[:-1]  # as the engine leaves it out of its text
            self.token_ids.extend(delta.new_token_ids)
            counted = len(self.token_ids) - len(delta.new_token_ids)
            short = self.params.min_tokens - counted
            if short > 0:  # note where the text of the first min_tokens tokens ends
                head, ids = ids[:short], ids[short:]
                self.text += self.detok.add(head)
                if counted + len(head) == self.params.min_tokens:
                    self.stop_search_from = len(self.text)
            if ids:
                self.text += self.detok.add(ids)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            if self.token_ids:
                self.text += self.detok.flush()
            self.final = delta
            self.text = self._final_text(delta)

    def _final_text(self, delta: EngineDelta) -> str:
        text = self.text
        if delta.finish_reason == "stop" and isinstance(delta.stop_reason, str):
            hit = first_stop_ending_after(text, self.params.stop, self.stop_search_from)
            if hit is not None:
                idx, stop = hit
                text = text[:idx + len(stop) if self.params.include_stop_str_in_output else idx]
        if delta.text is not None and delta.text != text and delta.error is None:
            logger.debug("request %s: front-end text differs from the engine's (%d vs %d chars)",
                         self.request_id, len(text), len(delta.text))
        return text

    def take_text(self) -> str:
        """Text not yet streamed that is safe to send (all of it once finished)."""
        end = len(self.text) if self.finished else len(self.text) - self.holdback
        if end <= self.sent_chars:
            return ""
        out = self.text[self.sent_chars:end]
        self.sent_chars = end
        return out

    def take_logprobs(self) -> list[LogprobEntry]:
        """Log-prob entries not yet streamed."""
        out = self.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(self.logprobs)
        return out

    def rejection(self) -> APIError | None:
        """The HTTP error for a request that failed before producing any token, else None."""
        d = self.final
        if d is None or d.error is None or self.token_ids:
            return None
        return self.failure()

    def failure(self) -> APIError:
        """The HTTP error for this finished, failed choice (:func:`error_for`)."""
        if self.final is None:  # callers ask finished choices only; never report success
            return server_error(f"request {self.request_id} has not finished")
        return error_for(self.final, self.grammar_param)


def error_for(delta: EngineDelta, grammar_param: str | None = None) -> APIError:
    """Map a failed engine request to an HTTP error (400 for bad input).

    Args:
        grammar_param: the request field the request's grammar was read from; a grammar
            error (its ``error_param`` one of :data:`GRAMMAR_KIND_PARAMS`, or a place in a
            structural tag) names it instead of the engine's kind-based name (``regex`` for a
            ``response_format`` regex; :func:`request_param`).
    """
    msg = delta.error or "request aborted"
    if delta.rejected or delta.error_param is not None:
        param = request_param(delta.error_param, grammar_param)
        # the engine's code, or (bad_request) the generic one by the field
        return bad_request(msg, param, code=delta.error_code)
    if msg.startswith(SHUTDOWN_ERRORS):
        return unavailable(msg)
    return server_error(msg)


class GenerationRun:
    """Submit, follow and (if needed) abort the engine requests of one HTTP request.

    Args:
        engine: the engine handle.
        codec: for detokenizers.
        metrics: where finished requests are recorded.
        request_id: the response id; engine requests are ``{request_id}-{i}``.
        items: ``(prompt_ids, params)`` per choice, in choice order.
        start_s: ``time.perf_counter()`` when the HTTP request arrived.
        grammar_param: the request field the grammar (if any) was read from, named by its
            compile errors (:func:`error_for`).
        priority: the request's ``priority`` (lower is served first), for every choice.
    """

    def __init__(self, engine: AsyncEngine, codec: Codec, metrics: ServerMetrics,
                 request_id: str, items: Sequence[tuple[list[int], SamplingParams]],
                 start_s: float, grammar_param: str | None = None, priority: int = 0) -> None:
        self.engine = engine
        self.priority = priority
        self.metrics = metrics
        self.request_id = request_id
        self.start_s = start_s
        self.queue: asyncio.Queue[EngineDelta] = asyncio.Queue()
        self.choices = [
            ChoiceState(index=i, request_id=f"{request_id}-{i}", prompt_ids=ids, params=params,
                        detok=codec.detokenizer(
                            ids, skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=(
                                params.spaces_between_special_tokens)),
                        grammar_param=grammar_param)
            for i, (ids, params) in enumerate(items)
        ]
        self._by_rid = {c.request_id: c for c in self.choices}
        self._started: list[ChoiceState] = []

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def start(self) -> None:
        """Queue every choice in the engine.

        Raises:
            APIError: 503 when the engine is not serving; 400 when the request cannot be
                pickled for the engine process (nested past the recursion limit).
        """
        for c in self.choices:
            try:
                self.engine.add_request(c.request_id, c.prompt_ids, c.params, self.queue,
                                        priority=self.priority)
            except EngineDeadError as e:
                self.abort()
                raise unavailable(f"the engine is not serving: {e}") from None
            except RecursionError:
                self.abort()
                raise bad_request("the request is nested too deeply to pass to the engine "
                                  "process") from None
            self._started.append(c)

    async def next(self) -> ChoiceState:
        """Wait for the next delta; return the choice it advanced."""
        delta = await self.queue.get()
        choice = self._by_rid[delta.request_id]
        prefilled = choice.first_token_s is not None
        choice.apply(delta, time.perf_counter() - self.start_s)
        if delta.new_token_ids:  # the prompt counts once its first token shows it processed
            self.metrics.on_tokens(0 if prefilled else len(choice.prompt_ids),
                                   len(delta.new_token_ids))
        if choice.finished and not choice.recorded:
            choice.recorded = True
            self.metrics.on_finished(choice, time.perf_counter() - self.start_s)
        return choice

    async def wait_all(self) -> None:
        """Run until every choice finished; raise on an early failure.

        Raises:
            APIError: the first choice that failed before any token (e.g. 400 for a schema
                the compiler rejects); the other choices are aborted.
        """
        while not self.done:
            choice = await self.next()
            err = choice.rejection()
            if err is not None:
                self.abort()
                raise err

    async def wait_first(self) -> None:
        """Run until some choice has output or finished (before sending stream headers).

        Raises:
            APIError: as :meth:`wait_all` for a choice that failed before any token.
        """
        while not self.done:
            choice = await self.next()
            err = choice.rejection()
            if err is not None:
                self.abort()
                raise err
            if choice.token_ids or choice.finished:
                return

    def abort(self) -> None:
        """Abort every started choice that has not finished (idempotent). Nobody reads
        their final deltas after this, so they are counted as aborted here."""
        for c in self._started:
            if not c.finished and not c.recorded:
                c.recorded = True
                self.engine.abort_request(c.request_id)
                self.metrics.on_abandoned(c)

    # ------------------------------------------------------------------ usage

    def usage(self, prompt_tokens: int) -> dict[str, object]:
        """OpenAI ``usage`` (``prompt_tokens_details.cached_tokens``: the prompt tokens whose
        KV came from the prefix cache, per prompt the most any of its choices reused, summed
        over prompts) plus ``speculative`` (summed over choices)."""
        completion = sum(len(c.token_ids) for c in self.choices)
        spec = SpecMetrics()
        cached: dict[int, int] = {}  # per prompt (choices of one prompt share its id list)
        for c in self.choices:
            if c.final is not None:
                key = id(c.prompt_ids)
                cached[key] = max(cached.get(key, 0), c.final.num_cached_tokens)
                if c.final.spec is not None:
                    spec.add(c.final.spec)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
            "speculative": spec.to_dict(),
        }
