"""Admission limits and input checks of the HTTP front end, against the fake engine (fast).

Each case was a defect: a request that queued thousands of engine requests ahead of everyone
(``prompt`` x ``n``), bad input accepted with a 200 (``max_tokens: -7`` beside
``max_completion_tokens``, ``content: []``, lone surrogates in ``stop`` / ``tools``,
``stop_token_ids: [2**64]``) or a 500 (a lone surrogate in ``model``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from structspec.server.app import create_app
from structspec.server.limits import ServerLimits
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.server_fakes import FakeCodec, FakeEngine

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def make_state(engine: FakeEngine | None = None, **limits: int) -> ServerState:
    return ServerState(engine=engine or FakeEngine(), codec=FakeCodec(),
                       metrics=ServerMetrics(), model_name="fake",
                       limits=ServerLimits(**limits))


def post_raw(c: TestClient, path: str, raw: bytes) -> httpx.Response:
    return c.post(path, content=raw, headers={"content-type": "application/json"})


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    err: dict[str, Any] = r.json()["error"]
    return err


def test_prompts_times_n_over_the_limit_is_400_naming_n_or_prompt() -> None:
    engine = FakeEngine()
    with TestClient(create_app(make_state(engine))) as c:
        # the attack: 100 prompts x n=64 used to queue 6,400 engine requests
        r = c.post(COMPLETIONS, json={"prompt": [f"word {i}" for i in range(100)], "n": 64,
                                      "max_tokens": 1})
        err = error_of(r)
        assert err["param"] == "n" and err["code"] == "too_many_choices", err
        assert "100 prompts x n=64 = 6400 completions; at most 128" in err["message"]
        r = c.post(COMPLETIONS, json={"prompt": ["w"] * 129, "max_tokens": 1})
        assert error_of(r)["param"] == "prompt"
        assert engine.added == []  # refused before anything reached the engine
        r = c.post(COMPLETIONS, json={"prompt": ["w"] * 64, "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 128
    with TestClient(create_app(make_state(max_choices_per_request=4))) as c:
        err = error_of(c.post(CHAT, json={"messages": MSGS, "n": 5, "max_tokens": 1}))
        assert err["param"] == "n" and "n=5 completions; at most 4" in err["message"]


def test_full_queue_is_429_with_retry_after() -> None:
    """A request that would put more engine requests in flight than --max-queued-requests
    is a 429 with Retry-After; once the queue drains the same request is served."""
    engine = FakeEngine(tick_s=0.01)
    app = create_app(make_state(engine, max_queued_requests=4, max_choices_per_request=4))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            long = asyncio.ensure_future(c.post(CHAT, json={"messages": MSGS, "n": 3,
                                                            "max_tokens": 30}))
            for _ in range(500):
                if engine.num_inflight == 3:
                    break
                await asyncio.sleep(0.005)
            assert engine.num_inflight == 3
            r = await c.post(CHAT, json={"messages": MSGS, "n": 2, "max_tokens": 1})
            err = error_of(r, 429)
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error", err
            assert r.headers["retry-after"] == "1"
            r = await c.post(CHAT, json={"messages": MSGS, "n": 1, "max_tokens": 1})
            assert r.status_code == 200, r.text  # one place was left
            assert (await long).status_code == 200
            r = await c.post(CHAT, json={"messages": MSGS, "n": 2, "max_tokens": 1})
            assert r.status_code == 200, r.text

    asyncio.run(scenario())


@pytest.mark.parametrize("path,body,param,words", [
    (COMPLETIONS, {"prompt": "x" * 101}, "prompt", "101 characters; at most 100"),
    (COMPLETIONS, {"prompt": ["x" * 60, "y" * 60]}, "prompt", "120 characters"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 101}]}, "messages", "101 char"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function",
                                          "function": {"name": "f" * 100}}]}, "messages", ""),
    (CHAT, {"messages": MSGS, "regex": "a" * 51}, "regex", "regex grammar has 51 characters"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * 50}}}},
     "response_format.json_schema", "json_schema grammar has"),
    (COMPLETIONS, {"prompt": "x", "choice": ["a" * 30, "b" * 30]}, "choice", "at most 50"),
    (CHAT, {"messages": MSGS, "stop": ["a"] * 5}, "stop", "stop has 5 entries; at most 4"),
    (CHAT, {"messages": MSGS, "stop": "s" * 11}, "stop", "stop has 11 characters"),
    (COMPLETIONS, {"prompt": "x", "stop": ["ok", "s" * 11]}, "stop", "stop[1] has 11"),
    (CHAT, {"messages": MSGS, "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids",
     "5 entries; at most 4"),
], ids=["prompt", "prompts", "messages", "tools", "regex", "schema", "choice", "stop-count",
        "stop-chars", "stop-chars-list", "stop-ids-count"])
def test_size_limits_are_400_naming_the_field(path: str, body: dict[str, Any], param: str,
                                              words: str) -> None:
    engine = FakeEngine()
    state = make_state(engine, max_prompt_chars=100, max_grammar_chars=50,
                       max_stop_sequences=4, max_stop_chars=10)
    with TestClient(create_app(state)) as c:
        err = error_of(c.post(path, json={"max_tokens": 2, **body}))
        assert err["param"] == param and words in err["message"], err
        assert engine.added == []


def test_body_over_the_limit_is_413_without_reading_it_whole() -> None:
    with TestClient(create_app(make_state(max_request_bytes=1000))) as c:
        body = json.dumps({"prompt": "x" * 2000, "max_tokens": 1}).encode()
        err = error_of(post_raw(c, COMPLETIONS, body), 413)
        assert err["code"] == "request_too_large" and "1000 bytes" in err["message"]

        def chunks() -> Any:  # no Content-Length: the bound applies while reading
            for i in range(0, len(body), 100):
                yield body[i:i + 100]

        r = c.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        assert error_of(r, 413)["code"] == "request_too_large"
        r = c.post(COMPLETIONS, json={"prompt": "x" * 100, "max_tokens": 1})
        assert r.status_code == 200, r.text


HEAD = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '


@pytest.mark.parametrize("path,raw,param", [
    (CHAT, b'{"model": "x\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (COMPLETIONS, b'{"model": "x\\ud800", "prompt": "hi"}', "model"),
    (CHAT, HEAD + b'"stop": ["\\ud800"]}', "stop[0]"),
    (CHAT, HEAD + b'"stop": ["\xed\xa0\x80"]}', "stop[0]"),  # invalid UTF-8 (a surrogate)
    (COMPLETIONS, b'{"prompt": "hi", "stop": "ok\\udfff"}', "stop"),
    (CHAT, HEAD + b'"tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}',
     "tools[0].function.name"),
    (CHAT, HEAD + b'"tools": [{"type": "function", "function": {"name": "\xed\xa0\x80"}}]}',
     "tools[0].function.name"),
    (CHAT, HEAD + b'"json_schema": {"properties": {"a\\ud800": {}}}}', "json_schema.properties"),
], ids=["model-chat", "model-completion", "stop", "stop-utf8", "stop-str", "tools",
        "tools-utf8", "schema-key"])
def test_lone_surrogates_are_400_naming_the_field(path: str, raw: bytes, param: str) -> None:
    engine = FakeEngine()
    with TestClient(create_app(make_state(engine)), raise_server_exceptions=False) as c:
        err = error_of(post_raw(c, path, raw))
        assert err["param"] == param, err
        assert "not valid Unicode: a lone surrogate" in err["message"], err
        assert engine.added == []
        # a valid surrogate pair (an emoji as two escapes) is fine
        r = post_raw(c, CHAT, HEAD + b'"stop": ["\\ud83d\\ude00"]}')
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param,words", [
    ({"max_tokens": -7, "max_completion_tokens": 3}, "max_tokens",
     "max_tokens must be at least 1, got -7"),
    ({"max_tokens": 0, "max_completion_tokens": 3}, "max_tokens", "got 0"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content",
     "non-empty list of text parts, got an empty list"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
], ids=["max_tokens-negative", "max_tokens-zero", "content-empty-list", "stop-id-huge",
        "stop-id-negative"])
def test_bad_input_that_was_accepted_is_400(body: dict[str, Any], param: str,
                                            words: str) -> None:
    engine = FakeEngine()
    with TestClient(create_app(make_state(engine))) as c:
        err = error_of(c.post(CHAT, json={"messages": MSGS, "max_tokens": 2, **body}))
        assert err["param"] == param and words in err["message"], err
        assert engine.added == []


def test_stop_token_ids_inside_the_vocabulary_still_work() -> None:
    engine = FakeEngine()
    with TestClient(create_app(make_state(engine))) as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "max_completion_tokens": 3,
                               "stop_token_ids": [0, 0x10FFFF]})
        assert r.status_code == 200, r.text
        assert engine.added[-1][2].stop_token_ids == (0, 0x10FFFF)
        assert engine.added[-1][2].max_tokens == 3  # max_completion_tokens wins
