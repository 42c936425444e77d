"""Admission limits of the HTTP server: how much one request may ask for, and how many
engine requests may wait at once.

Every request is checked in the front end before anything reaches the engine process.
One HTTP request fans out into ``prompts x n`` engine requests and the scheduler serves
them first come, first served, so without a bound one request (``{"prompt": [100
prompts], "n": 64}`` = 6,400 engine requests) held up every later request for a minute.
A request over a per-request bound is a 400 naming the field; a request that would push the
number of engine requests in flight past :attr:`ServerLimits.max_queued_requests` is a 429
with a ``Retry-After`` header (:class:`QueueFullError`): the client may retry it later as is.

:class:`ServerLimits` holds the bounds (``structspec serve`` flags, :func:`add_limit_args`);
the ``check_*`` functions apply them. Nothing here imports fastapi or torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.server.errors import APIError, bad_request
from structspec.server.params import MAX_N

RETRY_AFTER_S = 1
"""The ``Retry-After`` (seconds) of a 429: about the time a batch of short requests takes to
make room. Clients with back-off (the ``openai`` SDK) retry on their own."""


@dataclass(frozen=True)
class ServerLimits:
    """Bounds applied to every request (the defaults are the ``structspec serve`` defaults).

    Attributes:
        max_choices_per_request: engine requests one HTTP request may start: ``n`` for a chat
            completion, ``len(prompt) x n`` for a completion.
        max_queued_requests: engine requests in flight (running or waiting in the engine, of
            all HTTP requests together); a request that would go past it is a 429. At least
            ``max_choices_per_request``, so that every valid request can be admitted.
        max_prompt_chars: characters of prompt text in one request (a completion's prompts
            together; a chat's message contents plus its ``tools`` and ``chat_template_kwargs``
            as JSON). Token counts are bounded separately by the model's context
            (``context_length_exceeded``).
        max_grammar_chars: characters of the request's grammar: a JSON Schema as compact
            JSON, a regex, an EBNF grammar, or a choice list as JSON.
        max_stop_sequences: entries in ``stop`` and, separately, in ``stop_token_ids``.
        max_stop_chars: characters of one ``stop`` string.
        max_request_bytes: bytes of one request body (a 413 beyond; checked while reading, so
            a larger body is never held in memory).
    """

    max_choices_per_request: int = 128
    max_queued_requests: int = 1024
    max_prompt_chars: int = 1_000_000
    max_grammar_chars: int = 4 * 1024 * 1024  # = the engine's grammar text limit (grammar/limits.py)
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    max_request_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r}: expected an integer >= 1")
        if self.max_queued_requests < self.max_choices_per_request:
            raise ValueError(f"max_queued_requests={self.max_queued_requests} is below "
                             f"max_choices_per_request={self.max_choices_per_request}: a "
                             "request that many choices could never be admitted")


FLAG_OF_LIMIT = {name: "--" + name.replace("_", "-") for name in (
    "max_choices_per_request", "max_queued_requests", "max_prompt_chars",
    "max_grammar_chars", "max_stop_sequences", "max_stop_chars", "max_request_bytes")}
"""Each :class:`ServerLimits` field and its ``structspec serve`` flag."""


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Add the "admission limits" flags of ``structspec serve`` (read back with
    :func:`limits_from_args`)."""
    d = ServerLimits()
    g = p.add_argument_group("admission limits")
    g.add_argument("--max-choices-per-request", type=int, default=d.max_choices_per_request,
                   help="engine requests one HTTP request may start (n for chat, prompts x n "
                        "for completions); more is a 400 naming n or prompt")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="engine requests in flight, all clients together; a request that "
                        "would exceed it is a 429 with Retry-After")
    g.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="characters of prompt text per request (400 naming the field)")
    g.add_argument("--max-grammar-chars", type=int, default=d.max_grammar_chars,
                   help="characters of a request's JSON Schema (compact JSON), regex, EBNF "
                        "grammar or choice list (400 naming the field)")
    g.add_argument("--max-stop-sequences", type=int, default=d.max_stop_sequences,
                   help="entries of stop, and of stop_token_ids (400 naming the field)")
    g.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="characters of one stop string (400 naming stop)")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="bytes of one request body (413 beyond)")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The :class:`ServerLimits` of the flags added by :func:`add_limit_args`.

    Raises:
        ValueError: a bound below 1, or ``--max-queued-requests`` below
            ``--max-choices-per-request``; the message starts with the flag.
    """
    values = {name: getattr(args, name) for name in FLAG_OF_LIMIT}
    try:
        return ServerLimits(**values)
    except ValueError as e:
        field = str(e).split("=", 1)[0]
        raise ValueError(f"{FLAG_OF_LIMIT.get(field, field)}: {e}") from None


class RetryLaterError(APIError):
    """An error the client may retry as is after ``retry_after_s`` seconds; ``headers``
    (``Retry-After``) go with the response."""

    def __init__(self, status: int, message: str, *, retry_after_s: int, type: str,
                 code: str) -> None:
        super().__init__(status, message, type=type, code=code)
        self.headers = {"Retry-After": str(retry_after_s)}


class QueueFullError(RetryLaterError):
    """The 429 for a request refused because the engine queue is full."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(429, message, retry_after_s=retry_after_s, type="rate_limit_error",
                         code="queue_full")


class BodyTooLargeError(APIError):
    """The 413 for a request body over :attr:`ServerLimits.max_request_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {limit_bytes} bytes (the "
                              "server's --max-request-bytes)", code="request_too_large")


def check_choices(limits: ServerLimits, num_prompts: int, n: int) -> None:
    """Raises: APIError 400 when ``num_prompts x n`` is over the per-request bound, naming
    ``n`` when several choices per prompt were asked for, else ``prompt``."""
    if not 1 <= n <= MAX_N:  # the per-prompt bound first: one message for one limit
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    total = num_prompts * n
    if total <= limits.max_choices_per_request:
        return
    what = (f"{num_prompts} prompts x n={n} = {total} completions" if num_prompts > 1
            else f"n={n} completions")
    raise bad_request(f"this request asks for {what}; at most "
                      f"{limits.max_choices_per_request} per request (the server's "
                      "--max-choices-per-request)", "n" if n > 1 else "prompt",
                      code="too_many_choices")


def check_queue(limits: ServerLimits, num_inflight: int, num_new: int) -> None:
    """Raises: :class:`QueueFullError` (429) when ``num_new`` more engine requests would put
    more than ``max_queued_requests`` in flight."""
    if num_inflight + num_new > limits.max_queued_requests:
        raise QueueFullError(f"the server is at capacity ({num_inflight} requests in flight, "
                             f"at most {limits.max_queued_requests}); retry after "
                             f"{RETRY_AFTER_S} s")


def check_prompt_chars(limits: ServerLimits, num_chars: int, param: str) -> None:
    """Raises: APIError 400 naming ``param`` when a request's prompt text is over the bound."""
    if num_chars > limits.max_prompt_chars:
        raise bad_request(f"{param}: the prompt text has {num_chars} characters; at most "
                          f"{limits.max_prompt_chars} per request (the server's "
                          "--max-prompt-chars)", param, code="prompt_too_large")


def grammar_chars(grammar: GrammarConstraint) -> int:
    """Characters of ``grammar`` as the client wrote it (a schema as compact JSON)."""
    if isinstance(grammar, JsonSchemaConstraint):
        schema = grammar.schema
        if isinstance(schema, str):
            return len(schema)
        return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if isinstance(grammar, RegexConstraint):
        return len(grammar.pattern)
    if isinstance(grammar, EbnfConstraint):
        return len(grammar.grammar)
    if isinstance(grammar, ChoiceConstraint):
        return len(json.dumps(list(grammar.choices), ensure_ascii=False))
    if isinstance(grammar, StructuralTagConstraint):
        tag = grammar.tag
        if isinstance(tag, str):
            return len(tag)
        return len(json.dumps(tag, separators=(",", ":"), ensure_ascii=False))
    return 0


def check_grammar_size(limits: ServerLimits, grammar: GrammarConstraint | None,
                       param: str | None) -> None:
    """Raises: APIError 400 naming ``param`` (the field the grammar was read from) when the
    grammar is over :attr:`ServerLimits.max_grammar_chars`."""
    if grammar is None:
        return
    size = grammar_chars(grammar)
    if size > limits.max_grammar_chars:
        raise bad_request(f"{param}: the {grammar.kind} grammar has {size} characters; at most "
                          f"{limits.max_grammar_chars} (the server's --max-grammar-chars)",
                          param, code="grammar_too_large")


def check_stop(limits: ServerLimits, stop: Sequence[Any] | str | None,
               stop_token_ids: Sequence[Any] | None, vocab_size: int) -> None:
    """Bound ``stop`` / ``stop_token_ids`` and check the ids against the vocabulary.

    Raises:
        APIError: 400 naming ``stop`` or ``stop_token_ids``.
    """
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop_sequences:
        raise bad_request(f"stop has {len(stops)} entries; at most {limits.max_stop_sequences} "
                          "(the server's --max-stop-sequences)", "stop")
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise bad_request(f"{where} has {len(s)} characters; at most "
                              f"{limits.max_stop_chars} (the server's --max-stop-chars)",
                              "stop")
    ids = list(stop_token_ids or ())
    if len(ids) > limits.max_stop_sequences:
        raise bad_request(f"stop_token_ids has {len(ids)} entries; at most "
                          f"{limits.max_stop_sequences} (the server's --max-stop-sequences)",
                          "stop_token_ids")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(f"stop_token_ids[{i}] = {t} is outside the vocabulary "
                              f"[0, {vocab_size})", "stop_token_ids")
