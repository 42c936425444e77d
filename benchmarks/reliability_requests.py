"""The request mix of the reliability runs and how each answer's output is validated.

Kinds (:data:`GOOD_KINDS`): ``json_schema`` (a small object schema, checked with
``jsonschema`` when the choice finished with ``stop``), ``regex``, ``choice`` and ``none``
(no grammar); ``bad_schema`` is a schema the grammar compiler refuses (a 400 naming the
field); ``hostile`` is one request of :mod:`benchmarks.hostile_requests`. A request may be
streamed, ask for ``n = 2`` choices, and may be dropped by its client after a few SSE events
(a mid-stream disconnect).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import jsonschema

from benchmarks.hostile_requests import (
    CHAT,
    COMPLETIONS,
    HostileRequest,
    chat_body,
    completion_body,
    encode,
)

COLOR_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
    },
    "required": ["color", "bright"],
    "additionalProperties": False,
}
ANSWER_REGEX = r"(yes|no), [0-9]{1,2}"
CITIES = ["Paris", "London", "Rome"]
GOOD_KINDS = ("json_schema", "regex", "choice", "none")
PROMPTS = (
    "Pick a color; is it bright? Answer in JSON.",
    "Is the sky blue? Answer yes or no and a number.",
    "Name a European capital.",
    "Tell a long story about the sea.",
)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a reliability run.

    Args:
        index: position in the run.
        kind: ``json_schema``, ``regex``, ``choice``, ``none``, ``bad_schema`` or
            ``hostile``.
        path: the endpoint.
        raw: the body as sent.
        stream: whether the body asks for SSE.
        n: choices per prompt asked for.
        disconnect_after: the client closes the connection after this many SSE ``data``
            events (None: read to the end).
        hostile: the catalogue entry of a ``hostile`` request.
        bad_field: the field a ``bad_schema`` request's 400 must name.
    """

    index: int
    kind: str
    path: str
    raw: bytes
    stream: bool = False
    n: int = 1
    disconnect_after: int | None = None
    hostile: HostileRequest | None = None
    bad_field: str | None = None

    @property
    def expect_error(self) -> bool:
        """Whether the right answer is a 4xx."""
        return self.kind in ("bad_schema", "hostile")


def output_problem(kind: str, text: str) -> str | None:
    """Why ``text``, an output that finished with ``stop`` under grammar ``kind``, is not
    valid; None when it is (always for ``none``)."""
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), COLOR_SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"json_schema output {text!r} invalid: {str(e).splitlines()[0]}"
    elif kind == "regex":
        if not re.fullmatch(ANSWER_REGEX, text):
            return f"regex output {text!r} does not match {ANSWER_REGEX}"
    elif kind == "choice":
        if text not in CITIES:
            return f"choice output {text!r} not one of {CITIES}"
    return None


def good_request(index: int, kind: str, rng: random.Random, *, stream: bool, n: int,
                 max_tokens: int, disconnect_after: int | None = None,
                 model: str | None = None) -> PlannedRequest:
    """A valid request of grammar ``kind`` (one of :data:`GOOD_KINDS`), chat or completions,
    sampled (seeded) so that concurrent requests differ.

    Args:
        disconnect_after: see :class:`PlannedRequest`; such requests ask for
            ``max_tokens`` tokens with ``ignore_eos`` so that they are still running when
            the client leaves.
    """
    grammar: dict[str, object] = {}
    if kind == "json_schema":
        grammar = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "color", "schema": COLOR_SCHEMA, "strict": True}}}
    elif kind == "regex":
        grammar = {"regex": ANSWER_REGEX}
    elif kind == "choice":
        grammar = {"choice": CITIES}
    extra: dict[str, object] = {"temperature": 0.7, "seed": rng.randrange(10**6), "n": n,
                                "max_tokens": max_tokens, "stream": stream, **grammar}
    if disconnect_after is not None:
        extra["ignore_eos"] = kind == "none"
    if model is not None:
        extra["model"] = model
    prompt = PROMPTS[GOOD_KINDS.index(kind)]
    if rng.random() < 0.5:
        path, body = CHAT, chat_body(messages=[{"role": "user", "content": prompt}], **extra)
    else:
        path, body = COMPLETIONS, completion_body(prompt=prompt + "\nAnswer:", **extra)
    return PlannedRequest(index, kind, path, encode(body), stream, n, disconnect_after)


def bad_schema_request(index: int, rng: random.Random, *, stream: bool, n: int,
                       model: str | None = None) -> PlannedRequest:
    """A request whose JSON Schema the grammar compiler refuses (unique per ``index``, so no
    compile cache answers it)."""
    schema = {"type": "object", "title": f"bad{index}-{rng.randrange(10**9)}",
              "properties": {"a": {"type": "nonsense"}}, "required": ["a"]}
    extra: dict[str, object] = {"n": n, "stream": stream, "max_tokens": 8}
    if model is not None:
        extra["model"] = model
    body = chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": schema}}, **extra)
    return PlannedRequest(index, "bad_schema", CHAT, encode(body), stream, n,
                          bad_field="response_format.json_schema")


def hostile_request(index: int, hostile: HostileRequest) -> PlannedRequest:
    """A catalogue request as a planned one (never streamed: most bodies are not even
    JSON)."""
    return PlannedRequest(index, "hostile", hostile.path, hostile.raw, hostile=hostile)


def mixed_requests(count: int, seed: int, *, hostile: list[HostileRequest],
                   disconnect_fraction: float, bad_fraction: float, n2_fraction: float,
                   max_tokens: int, model: str | None = None) -> list[PlannedRequest]:
    """``count`` requests mixing :data:`GOOD_KINDS` (streamed or not, ``n`` 1 or 2),
    mid-stream disconnects, bad schemas and ``hostile`` requests (taken in order, cycling).

    Args:
        disconnect_fraction: share of requests whose client leaves mid-stream (these run
            ``4 * max_tokens`` tokens so that they are still running then).
        bad_fraction: share of bad inputs; half bad schemas, half hostile requests (all bad
            schemas when ``hostile`` is empty).
        n2_fraction: share of good requests asking for two choices.

    Raises:
        ValueError: the fractions add up to more than 1.
    """
    if disconnect_fraction + bad_fraction > 1:
        raise ValueError("disconnect_fraction + bad_fraction must be at most 1")
    rng = random.Random(seed)
    out: list[PlannedRequest] = []
    k_hostile = 0
    for i in range(count):
        kind = GOOD_KINDS[i % len(GOOD_KINDS)]
        n = 2 if rng.random() < n2_fraction else 1
        u = rng.random()
        if u < disconnect_fraction:
            out.append(good_request(i, kind, rng, stream=True, n=n, max_tokens=4 * max_tokens,
                                    disconnect_after=rng.randrange(2, 5), model=model))
        elif u < disconnect_fraction + bad_fraction:
            if hostile and rng.random() < 0.5:
                out.append(hostile_request(i, hostile[k_hostile % len(hostile)]))
                k_hostile += 1
            else:
                out.append(bad_schema_request(i, rng, stream=rng.random() < 0.5, n=n,
                                              model=model))
        else:
            out.append(good_request(i, kind, rng, stream=rng.random() < 0.7, n=n,
                                    max_tokens=max_tokens, model=model))
    return out
