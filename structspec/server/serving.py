"""Pieces shared by the chat and completions endpoints: server state, JSON/SSE helpers,
disconnect handling, tokenization off the event loop, log-prob formatting."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from structspec.core import CONTEXT_LENGTH_EXCEEDED
from structspec.server.codec import Codec, Detokenizer
from structspec.server.engine_client import AsyncEngine
from structspec.server.errors import APIError, bad_request, model_not_found, unavailable
from structspec.server.generation import ChoiceState, GenerationRun, LogprobEntry
from structspec.server.jsontext import loads_client_json
from structspec.server.limits import (
    BodyTooLargeError,
    RetryLaterError,
    ServerLimits,
    check_queue,
)
from structspec.server.log_config import ServerLogConfig
from structspec.server.metrics import ServerMetrics

T = TypeVar("T")

MIN_LOGPROB = -9999.0  # what -inf (a token the grammar forbids) is reported as; JSON has no inf
RESTART_RETRY_AFTER_S = 5  # Retry-After of a 503 while the engine process restarts


@dataclass
class ServerState:
    """What the endpoints share.

    Args:
        engine: the engine handle.
        codec: tokenization in this process.
        metrics: Prometheus metrics.
        model_name: the model id in the API (``/v1/models``, response ``model``); the only
            ``model`` a request may name (:meth:`check_model`).
        api_key: required bearer token, or None.
        limits: admission limits (:mod:`structspec.server.limits`).
        log_config: the request and stats log lines (:mod:`structspec.server.log_config`).
        tool_call_parser: ``--tool-call-parser``: ``"hermes"`` reads auto tool calls
            (:mod:`structspec.server.hermes_tools`); None (the default) leaves ``tool_choice``
            ``"auto"`` answers as plain text.
    """

    engine: AsyncEngine
    codec: Codec
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_config: ServerLogConfig = field(default_factory=ServerLogConfig)
    tool_call_parser: str | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    def check_model(self, name: str | None) -> None:
        """Accept a request's ``model``: the served name, or none given (``null``, ``""`` or
        left out: the served model, as vLLM does).

        Raises:
            APIError: 404 ``NotFoundError`` (param ``model``) for any other name.
        """
        if name and name != self.model_name:
            raise model_not_found(name)

    def require_ready(self) -> None:
        """Raises: APIError 503 while the engine is not serving (with ``Retry-After`` while
        its process restarts)."""
        if self.engine.ready:
            return
        if getattr(self.engine, "restarting", False):
            raise RetryLaterError(503, "the engine process is restarting; retry shortly",
                                  retry_after_s=RESTART_RETRY_AFTER_S,
                                  type="service_unavailable", code="engine_unavailable")
        raise unavailable("the engine is not ready (starting, shutting down, or failed)")

    def admit(self, num_choices: int) -> None:
        """Check that ``num_choices`` more engine requests fit in the queue; call it right
        before starting them (no ``await`` in between, so concurrent requests cannot both
        take the last places).

        Raises:
            QueueFullError: 429 with ``Retry-After``.
        """
        check_queue(self.limits, getattr(self.engine, "num_inflight", 0), num_choices)


# --------------------------------------------------------------------------- bodies


async def read_json(request: Request, max_bytes: int | None = None) -> Any:
    """The request body as JSON.

    Args:
        max_bytes: the most body bytes read (None: no bound); checked against
            ``Content-Length`` and while reading, so a larger body is never held whole.

    Raises:
        APIError: 413 for a body over ``max_bytes``; 400 when it is not JSON, is JSON that
            Python's parser refuses (nesting too deep, an integer literal over the digit
            limit: the field is named), or holds a string that is not valid Unicode (a lone
            surrogate: the field is named).
    """
    if max_bytes is None:
        body = await request.body()
    else:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise BodyTooLargeError(max_bytes)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLargeError(max_bytes)
            chunks.append(chunk)
        body = b"".join(chunks)
    return loads_client_json(body, what="the request body", unicode_check=True)


def dumps(obj: Any) -> str:
    """Compact JSON (non-ASCII kept as is, except lone surrogates: UTF-8 cannot carry them,
    so a text holding one, e.g. a client's value echoed in an error, is escaped to ASCII)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text


def json_response(obj: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """A JSON response."""
    return Response(dumps(obj), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(err: APIError, metrics: ServerMetrics | None = None) -> Response:
    """The OpenAI-style error response for ``err`` (with its ``headers`` when it has some,
    e.g. a 429's ``Retry-After``)."""
    if metrics is not None:
        metrics.on_http_error(err.status)
    headers = err.headers if isinstance(err, RetryLaterError) else None
    return json_response(err.body(), err.status, headers)


def sse_event(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A ``text/event-stream`` response. Starlette cancels ``events`` when the client
    disconnects; its ``finally`` then aborts the engine requests."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --------------------------------------------------------------------------- running


async def wait_unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Await ``work`` unless the client disconnects first.

    Returns:
        ``(True, result)``, or ``(False, None)`` when the client went away (``work`` is
        cancelled; the caller aborts its engine requests).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return True, task.result()
    task.cancel()
    return False, None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_completion(request: Request, run: GenerationRun) -> bool:
    """Start ``run`` and wait for every choice; False when the client disconnected.

    Raises:
        APIError: a choice failed before producing tokens (e.g. a 400 from the compiler).
    """
    run.start()
    try:
        ok, _ = await wait_unless_disconnected(request, run.wait_all())
    finally:
        run.abort()  # no-op for finished choices; frees KV on disconnect / errors
    return ok


async def start_stream(request: Request, run: GenerationRun) -> bool:
    """Start ``run`` and wait until it has output, so that an early failure is still an HTTP
    error (status + JSON body) rather than an event inside a 200 stream.

    Returns:
        False when the client disconnected meanwhile (everything aborted).
    """
    run.start()
    try:
        ok, _ = await wait_unless_disconnected(request, run.wait_first())
    except BaseException:
        run.abort()
        raise
    if not ok:
        run.abort()
    return ok


_TOKENIZE_POOL: ThreadPoolExecutor | None = None


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run CPU work (tokenization, chat templates) off the event loop, on one dedicated
    thread: HF fast tokenizers are not safe to call from several threads at once."""
    global _TOKENIZE_POOL
    if _TOKENIZE_POOL is None:
        _TOKENIZE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structspec-tok")
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, fn, *args)


def check_prompt_length(num_tokens: int, max_model_len: int, param: str) -> None:
    """Raises: APIError 400 ``context_length_exceeded`` when the prompt leaves no room."""
    if num_tokens >= max_model_len:
        raise prompt_too_long(num_tokens, max_model_len, param)


def prompt_too_long(num_tokens: int, max_model_len: int, param: str, *,
                    at_least: bool = False, completion: bool = True) -> APIError:
    """The 400 ``context_length_exceeded`` for a prompt that leaves no room (``at_least``:
    ``num_tokens`` is a lower bound, from a prompt refused untokenized; ``completion`` False:
    a prompt only tokenized, ``/tokenize``, which is over the context itself)."""
    tail = (", which leaves no room for the completion. Please reduce the length of the "
            "prompt." if completion else ".")
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {'at least ' if at_least else ''}{num_tokens} tokens{tail}", param,
        code=CONTEXT_LENGTH_EXCEEDED)


# --------------------------------------------------------------------------- logprobs


def finite(lp: float) -> float:
    """``lp`` with -inf/NaN replaced by :data:`MIN_LOGPROB` (JSON cannot carry them)."""
    return lp if math.isfinite(lp) else MIN_LOGPROB


def token_id_str(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token: ``"token_id:{id}"`` (every
    token distinct, whatever its text; a client maps it back to the id)."""
    return f"token_id:{token_id}"


def chat_logprobs(codec: Codec, entries: list[LogprobEntry], *,
                  as_token_ids: bool = False) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    Args:
        as_token_ids: vLLM's ``return_tokens_as_token_ids``: each ``token`` is
            :func:`token_id_str`. ``bytes`` then follows vLLM's ``_create_chat_logprobs``: a
            chosen token's are its text's UTF-8 bytes, a ``top_logprobs`` entry's those of its
            ``"token_id:N"`` string.
    """

    def item(tok: int, lp: float, *, text_bytes: bool) -> dict[str, Any]:
        s = codec.token_str(tok)
        shown = token_id_str(tok) if as_token_ids else s
        return {"token": shown, "logprob": finite(lp),
                "bytes": list((s if text_bytes else shown).encode("utf-8"))}

    content = []
    for tok, lp, top in entries:
        d = item(tok, lp, text_bytes=True)
        d["top_logprobs"] = [item(t, v, text_bytes=False) for t, v in top if math.isfinite(v)]
        content.append(d)
    return {"content": content, "refusal": None}


@dataclass
class TextOffsets:
    """Where each generated token's text starts in a choice's text (the legacy
    ``text_offset``), token after token, across a stream's chunks.

    Attributes:
        pos: the next token's offset (characters).
        detok: an incremental detokenizer over the choice's tokens: a token's share of the
            text is what it adds there, so a character split over byte tokens counts once
            (a byte fragment's own string, ``"\ufffd"``, would count one each and run past
            the text); None: each token's own string.
    """

    pos: int
    detok: Detokenizer | None = None

    def take(self, codec: Codec, token: int) -> int:
        """``token``'s offset; moves past its text."""
        start = self.pos
        self.pos += (len(self.detok.add([token])) if self.detok is not None
                     else len(codec.token_str(token)))
        return start


def completion_logprobs(codec: Codec, entries: list[LogprobEntry],
                        text_offset: int | TextOffsets, *,
                        as_token_ids: bool = False) -> dict[str, Any]:
    """OpenAI legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs,
    text_offset (character offsets from ``text_offset``: an int, or a choice's
    :class:`TextOffsets`, which moves past these tokens).

    Args:
        as_token_ids: vLLM's ``return_tokens_as_token_ids``: ``tokens`` and the
            ``top_logprobs`` keys are :func:`token_id_str`. ``text_offset`` still counts the
            tokens' text, so that it indexes the completion's text (vLLM adds the length of
            the ``"token_id:N"`` strings there, offsets into no text).
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    shown = token_id_str if as_token_ids else codec.token_str
    at = text_offset if isinstance(text_offset, TextOffsets) else TextOffsets(text_offset)
    for tok, lp, top in entries:
        tokens.append(shown(tok))
        token_logprobs.append(finite(lp))
        tops.append(top_with_chosen(shown, tok, lp, top))
        offsets.append(at.take(codec, tok))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def top_with_chosen(shown: Callable[[int], str], token: int, logprob: float,
                    top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """A legacy completions ``top_logprobs`` entry: the ``top`` tokens (finite ones) and the
    chosen ``token`` itself when it is not among them, as OpenAI's legacy API ("the logprob
    of the sampled token is always returned, so there may be up to logprobs+1 elements")
    and vLLM list it."""
    out = {shown(t): finite(v) for t, v in top if math.isfinite(v)}
    if token not in {t for t, _ in top}:
        out.setdefault(shown(token), finite(logprob))
    return out


async def stream_choices(
    state: ServerState,
    run: GenerationRun,
    chunk: Callable[..., str],
    progress: Callable[[ChoiceState], list[str]],
    *,
    include_usage: bool,
    prompt_tokens: int,
    head: Sequence[str] = (),
) -> AsyncIterator[str]:
    """The SSE body shared by chat and text completions: ``head`` events, each choice's
    deltas as the engine produces them (``progress`` renders one choice's news), then a usage
    chunk (``include_usage``) and ``[DONE]``. A failure after output started is sent as an
    ``{"error": ...}`` event before ``[DONE]``. The run is aborted when the client goes away."""
    try:
        for e in head:
            yield e
        failure: APIError | None = None
        for c in run.choices:
            for e in progress(c):
                yield e
        while not run.done:
            c = await run.next()
            if c.finished and c.error is not None:
                failure = c.failure()
                break
            for e in progress(c):
                yield e
        if failure is None:
            failure = next((c.failure() for c in run.choices
                            if c.final is not None and c.error is not None), None)
        if failure is not None:
            run.abort()
            state.metrics.on_http_error(failure.status)
            yield sse_event(failure.body())
        elif include_usage:
            yield chunk([], run.usage(prompt_tokens))
        yield SSE_DONE
    finally:
        run.abort()


async def finish_or_error(state: ServerState, request: Request,
                          run: GenerationRun) -> Response | None:
    """Run a non-streamed request to the end. Returns the response to send instead of the
    result: 499 when the client left, the first choice's error (e.g. a grammar that failed to
    compile) as an OpenAI error; None when every choice finished normally."""
    if not await run_to_completion(request, run):
        return Response(status_code=499)
    for c in run.choices:
        if c.error is not None:
            return error_response(c.failure(), state.metrics)
    return None
