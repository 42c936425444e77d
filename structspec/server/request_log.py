"""One log line per generation request, written where its HTTP response is finalized.

:class:`RequestLogMiddleware` wraps every ``POST /v1/chat/completions`` and
``POST /v1/completions`` (pure ASGI, outside the exception handlers, so the error responses
they render pass through it) and writes exactly one line when the ASGI call ends, whatever
ended it: a JSON response, the last byte of an SSE stream, an error response, a client that
went away, an exception. The endpoint fills the request's :class:`RequestRecord` as it
learns things (grammar kind, prompt tokens, the :class:`~structspec.server.generation.
GenerationRun`); tokens, finish reasons, TTFT and accept lengths are read from the run's
choices, the same state ``usage`` and the Prometheus metrics read. On the
``structspec.server`` logger, INFO::

    request id=chatcmpl-1f.. endpoint=chat status=200 outcome=stop stream=false choices=1
        prompt_tokens=12 completion_tokens=34 latency_ms=412.7 ttft_ms=35.1
        grammar=json_schema accept_len=2.31

(one line). ``outcome``: the choices' finish reasons (``stop``, ``length``, ``abort``;
distinct ones comma-joined for several choices), ``error`` (then ``error=`` the OpenAI
``code``, else its ``type``, and ``param=`` when the error names a field; a stream that
failed after its 200 is ``status=200 outcome=error``), or ``disconnected`` (the client left:
``status=499`` before a response, the stream's status when it left mid-stream). ``-`` marks a
value not known: ``grammar=-`` for a request refused before its grammar was read,
``ttft_ms=-`` before any token, ``accept_len=-`` without verify steps.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from asyncio import CancelledError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from structspec.core import SpecMetrics

if TYPE_CHECKING:
    from structspec.server.generation import GenerationRun

logger = logging.getLogger("structspec.server")

ENDPOINTS = {"/v1/chat/completions": ("chat", "chatcmpl"), "/v1/completions": ("completions",
                                                                               "cmpl")}
"""Logged paths: their ``endpoint=`` name and response id prefix (OpenAI's)."""

RECORD_KEY = "structspec.request_record"  # where the record lives in the ASGI scope
MAX_ERROR_BODY_BYTES = 64 * 1024  # an error body read for its code / param (they are small)
DISCONNECTS = (ClientDisconnect, OSError, CancelledError)


@dataclass
class RequestRecord:
    """What the endpoint learned about one request, for its log line.

    Attributes:
        request_id: the response ``id`` (engine requests are ``{request_id}-{i}``).
        endpoint: ``chat`` or ``completions``.
        start_s: ``time.perf_counter()`` at the request's arrival; latency and TTFT count
            from here.
        stream: the request's ``stream`` (None until the body parsed).
        grammar: the grammar kind (``json_schema``, ``json_object``, ``regex``, ``ebnf``,
            ``choice``, ``structural_tag``) or ``none``; None until the grammar fields were
            read.
        prompt_tokens: as the response's ``usage.prompt_tokens`` (0 before tokenization).
        run: the engine requests, once built.
    """

    request_id: str
    endpoint: str
    start_s: float = field(default_factory=time.perf_counter)
    stream: bool | None = None
    grammar: str | None = None
    prompt_tokens: int = 0
    run: GenerationRun | None = None


def request_record(request: Request) -> RequestRecord:
    """The record of ``request`` (made by the middleware; made here when request logging is
    off, so the endpoints always have one)."""
    record = request.scope.get(RECORD_KEY)
    if record is None:
        record = request.scope[RECORD_KEY] = _new_record(request.scope)
    return record


def _new_record(scope: Scope) -> RequestRecord:
    endpoint, prefix = ENDPOINTS.get(scope.get("path", ""), ("chat", "chatcmpl"))
    return RequestRecord(request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint)


@dataclass
class _Sent:
    """What went out through ``send``: the status, whether the body ended, an error body."""

    status: int | None = None
    complete: bool = False
    error_body: bytearray = field(default_factory=bytearray)


class RequestLogMiddleware:
    """Writes one line per logged request (see the module docstring) when its ASGI call
    ends; other paths and methods pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in ENDPOINTS:
            await self.app(scope, receive, send)
            return
        record = scope[RECORD_KEY] = _new_record(scope)
        sent = _Sent()

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent.status = message["status"]
            elif message["type"] == "http.response.body" and sent.status is not None:
                if sent.status >= 400 and len(sent.error_body) < MAX_ERROR_BODY_BYTES:
                    sent.error_body += message.get("body", b"")
            await send(message)
            # the body counts as delivered only once its last part was sent
            if message["type"] == "http.response.body" and not message.get("more_body"):
                sent.complete = True

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, watched_send)
        except BaseException as e:
            failure = e
            raise
        finally:
            try:
                logger.info("%s", format_line(record, sent, failure, time.perf_counter()))
            except Exception:  # a log line must never cost the response
                logger.exception("request %s: could not write its log line",
                                 record.request_id)


def format_line(record: RequestRecord, sent: _Sent, failure: BaseException | None,
                end_s: float) -> str:
    """The one log line of ``record`` (module docstring), its response having ended at
    ``end_s`` (``time.perf_counter()``)."""
    status, outcome, error, param = _outcome(record, sent, failure)
    run = record.run
    choices = run.choices if run is not None else []
    firsts = [c.first_token_s for c in choices if c.first_token_s is not None]
    spec = SpecMetrics()
    for c in choices:
        if c.final is not None and c.final.spec is not None:
            spec.add(c.final.spec)
    parts = [f"id={record.request_id}", f"endpoint={record.endpoint}", f"status={status}",
             f"outcome={outcome}"]
    if error is not None:
        parts.append(f"error={_value(error)}")
    if param is not None:
        parts.append(f"param={_value(param)}")
    parts += [
        f"stream={'-' if record.stream is None else str(record.stream).lower()}",
        f"choices={len(choices)}",
        f"prompt_tokens={record.prompt_tokens}",
        f"completion_tokens={sum(len(c.token_ids) for c in choices)}",
        f"latency_ms={(end_s - record.start_s) * 1e3:.1f}",
        f"ttft_ms={min(firsts) * 1e3:.1f}" if firsts else "ttft_ms=-",
        f"grammar={record.grammar or '-'}",
        f"accept_len={spec.accept_length:.2f}" if spec.verify_steps else "accept_len=-",
    ]
    return "request " + " ".join(parts)


def _outcome(record: RequestRecord, sent: _Sent,
             failure: BaseException | None) -> tuple[int, str, str | None, str | None]:
    """``(status, outcome, error, param)`` of a finished request."""
    if sent.status is None:  # nothing was sent: the client left, or an exception escaped
        if failure is None or isinstance(failure, DISCONNECTS):
            return 499, "disconnected", None, None
        return 500, "error", type(failure).__name__, None
    if sent.status == 499:
        return 499, "disconnected", None, None
    if sent.status >= 400:
        error, param = _error_fields(bytes(sent.error_body))
        return sent.status, "error", error or str(sent.status), param
    if not sent.complete:  # a stream cut short (the client left, or an exception)
        if failure is None or isinstance(failure, DISCONNECTS):
            return sent.status, "disconnected", None, None
        return sent.status, "error", type(failure).__name__, None
    choices = record.run.choices if record.run is not None else []
    for c in choices:  # a stream that failed after its headers: the error event it sent
        if c.final is not None and c.error is not None:
            err = c.failure()
            return sent.status, "error", str(err.code if err.code is not None else err.type), \
                err.param
    reasons = list(dict.fromkeys(c.finish_reason or "abort" for c in choices))
    return sent.status, ",".join(reasons) or "ok", None, None


def _error_fields(body: bytes) -> tuple[str | None, str | None]:
    """``(code or type, param)`` of an OpenAI error body; Nones when it is not one."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None, None
    if not isinstance(err, dict):
        return None, None
    code = err.get("code") if err.get("code") is not None else err.get("type")
    param = err.get("param")
    return (None if code is None else str(code)), (None if param is None else str(param))


def _value(text: str) -> str:
    """``text`` as one key=value value: JSON-quoted when it holds a space, ``=`` or a quote
    (a ``param`` can name a client's key)."""
    if text and not any(ch.isspace() or ch in '="' for ch in text):
        return text
    return json.dumps(text, ensure_ascii=True)


def log_record_fields(line: str) -> dict[str, Any]:
    """The ``key=value`` fields of a server log line (the request line of
    :func:`format_line`, the stats line), quoted values unquoted, the leading word (``request``,
    ``stats``) left out; for tests and log readers."""
    fields: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    head, _, tail = line.partition(" ")
    rest = tail if "=" not in head else line
    i = 0
    while i < len(rest):
        eq = rest.index("=", i)
        key = rest[i:eq]
        if rest[eq + 1:eq + 2] == '"':
            value, end = decoder.raw_decode(rest, eq + 1)
        else:
            end = rest.find(" ", eq + 1)
            end = len(rest) if end == -1 else end
            value = rest[eq + 1:end]
        fields[key] = value
        i = end + 1
    return fields
