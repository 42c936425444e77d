"""End-to-end: one real server (SmolLM2-135M, CPU, fp32, no speculation, an API key) driven
with the official ``openai`` client and raw HTTP. Every request is short (few tokens) and
every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.server_proc import ServerHandle, running_server

API_KEY = "test-key"
MODEL = "smol"

COLOR_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
    },
    "required": ["color", "bright"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Pick a color; is it bright? Answer in JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    # --engine-restarts 0: the last test checks that a dead engine with no restart left
    # stops the server (restarts themselves: test_supervision.py)
    with running_server("--api-key", API_KEY, "--served-model-name", MODEL,
                        "--max-model-len", "1024", "--max-batch-size", "8",
                        "--engine-restarts", "0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120,
                         max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_health_and_auth(server: ServerHandle, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["kv_total_pages"] > 0
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                              max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert text and full.usage is not None and full.usage.completion_tokens <= 6
    spec = full.usage.model_extra["speculative"]  # type: ignore[index]
    assert spec["verify_steps"] >= 1 and spec["accept_length"] >= 1.0
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and
              c.choices[0].delta.content]
    assert "".join(pieces) == text
    # incremental: several content chunks, not the whole text at the end
    assert len(pieces) >= min(3, full.usage.completion_tokens - 1), pieces
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_and_stop(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8,
                                    temperature=0, stop=[" 7"])
    c = out.choices[0]
    assert " 7" not in c.text
    if c.finish_reason == "stop":
        assert c.text.strip().startswith("5")
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8,
                                            temperature=0, stop=[" 7"], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


def test_include_stop_str_in_output_and_special_tokens(client: openai.OpenAI) -> None:
    """vLLM's text options over HTTP: the stop string kept is the cut text plus the stop
    string, and the EOS that ended an answer shows as ``<|im_end|>`` with
    ``skip_special_tokens: false`` and ``include_stop_str_in_output``; streamed as whole."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                              stop=[" 7"])
    cut = client.completions.create(**kw).choices[0]
    assert cut.finish_reason == "stop", cut  # " 5, 6, 7": the stop string ended it
    keep = {"include_stop_str_in_output": True}
    kept = client.completions.create(**kw, extra_body=keep).choices[0]
    assert kept.text == cut.text + " 7" and kept.finish_reason == "stop"
    chunks = client.completions.create(**kw, extra_body=keep, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == kept.text
    chat: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    plain = client.chat.completions.create(**chat).choices[0]
    assert plain.finish_reason == "stop", plain  # at the EOS
    special = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    shown = client.chat.completions.create(**chat, extra_body=special).choices[0]
    assert shown.message.content == plain.message.content + "<|im_end|>"
    chunks = client.chat.completions.create(**chat, extra_body=special, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        shown.message.content


def _check(kind: str, text: str) -> None:
    if kind in ("json_schema", "guided_json"):
        jsonschema.validate(json.loads(text), COLOR_SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind in ("regex", "rf_regex", "structured_outputs"):
        assert re.fullmatch(r"(yes|no), [0-9]{1,2}", text), text
    elif kind == "ebnf":
        assert re.fullmatch(r"(cat|dog)!", text), text
    elif kind == "choice":
        assert text in ("Paris", "London", "Rome"), text


CASES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "color", "schema": COLOR_SCHEMA, "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"extra_body": {"regex": r"(yes|no), [0-9]{1,2}"}},
    "rf_regex": {"extra_body": {"response_format": {"type": "regex",
                                                    "pattern": r"(yes|no), [0-9]{1,2}"}}},
    "structured_outputs": {"extra_body": {"structured_outputs": {
        "regex": r"(yes|no), [0-9]{1,2}"}}},
    "ebnf": {"extra_body": {"ebnf": 'root ::= ("cat" | "dog") "!"'}},
    "choice": {"extra_body": {"choice": ["Paris", "London", "Rome"]}},
    "guided_json": {"extra_body": {"guided_json": COLOR_SCHEMA}},
}


COPY = [{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}]


@pytest.fixture(scope="module")
def structured_results(server: ServerHandle) -> dict[str, Any]:
    """Every case of CASES, sent concurrently (one batch: far cheaper than one by one)."""

    async def go() -> dict[str, Any]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                     timeout=120, max_retries=0)
        outs = await asyncio.gather(*(
            aclient.chat.completions.create(
                model=MODEL, messages=COPY if kind == "json_object" else ASK,
                max_tokens=24, temperature=0, **CASES[kind])
            for kind in CASES))
        await aclient.close()
        return dict(zip(CASES, outs, strict=True))

    return asyncio.run(go())


@pytest.mark.parametrize("kind", list(CASES))
def test_structured_chat(structured_results: dict[str, Any], kind: str) -> None:
    c = structured_results[kind].choices[0]
    assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
    _check(kind, c.message.content or "")


def test_structured_completions_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer yes or no and a number:", max_tokens=10,
        temperature=0.8, seed=3, stream=True, extra_body={"regex": r"(yes|no), [0-9]{1,2}"}))
    text = "".join(ch.choices[0].text for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    _check("regex", text)


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool


def test_parse_with_pydantic_model(client: openai.OpenAI) -> None:
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions.parse
    out = parse(model=MODEL, response_format=Weather, max_tokens=30, temperature=0,
                messages=[{"role": "user", "content": "Is it sunny in Rome? Answer in JSON."}])
    assert isinstance(out.choices[0].message.parsed, Weather)


class City(BaseModel):
    name: str
    country: str
    population: int


def test_parse_city_finishes_with_stop(client: openai.OpenAI) -> None:
    """Issue 20's example: with the default number bounds the integer ends (SmolLM2 used to
    write ``1000000...`` until max_tokens, and the SDK raised); the parse succeeds with
    finish_reason stop under default settings. With the bounds lifted it runs into the limit
    (what the guard prevents)."""
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions.parse
    ask = [{"role": "user", "content": "Describe Lisbon."}]
    out = parse(model=MODEL, response_format=City, max_tokens=60, temperature=0, messages=ask)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City) and choice.message.parsed.population > 0
    loose = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "City", "schema": City.model_json_schema(), "strict": True}},
        extra_body={"structured_outputs": {"bounded_numbers": False}})
    assert loose.choices[0].finish_reason == "length"


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    """vLLM's ``bad_words``: the greedy output's first word, banned, is not generated (its
    tokens, as is and with a leading space, are -inf), on both endpoints."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="The capital of France is", max_tokens=6,
                              temperature=0)
    word = client.completions.create(**kw).choices[0].text.split()[0]
    out = client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in out.split(), (word, out)
    chat = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    word = client.chat.completions.create(**chat).choices[0].message.content.split()[0]
    out = client.chat.completions.create(**chat, extra_body={"bad_words": [word]}
                                         ).choices[0].message.content
    assert word not in out.split(), (word, out)


def test_logprobs_n_and_seed(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0.9, seed=11, n=2,
        logprobs=True, top_logprobs=2, extra_body={"choice": ["alpha", "beta", "gamma"]})
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.message.content in ("alpha", "beta", "gamma")
        lp = c.logprobs.content  # type: ignore[union-attr]
        assert lp and all(t.logprob <= 0 and len(t.top_logprobs) <= 2 for t in lp)
        # grammar-masked: every listed alternative is a legal continuation (finite)
        assert all(t.logprob > -9999 for e in lp for t in e.top_logprobs)
    again = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0.9, seed=11, n=2,
        extra_body={"choice": ["alpha", "beta", "gamma"]})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_errors_are_400_while_others_complete(server: ServerHandle) -> None:
    url = server.url + "/v1/chat/completions"
    good = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "c", "schema": COLOR_SCHEMA, "strict": True}}}
    bad_schema = {**good, "response_format": {"type": "json_schema", "json_schema": {
        "name": "b", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
        "strict": True}}}
    bad_regex = {"model": MODEL, "messages": ASK, "max_tokens": 5, "regex": "([a-z"}
    too_long = {"model": MODEL, "max_tokens": 5,
                "messages": [{"role": "user", "content": "word " * 1500}]}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=auth(), timeout=120) as h:
            return list(await asyncio.gather(
                h.post(url, json=good), h.post(url, json=bad_schema),
                h.post(url, json=bad_regex), h.post(url, json=too_long),
                h.post(url, json={**good, "stream": True})))

    ok, schema_err, regex_err, long_err, ok_stream = asyncio.run(go())
    assert ok.status_code == 200, ok.text
    jsonschema.validate(json.loads(ok.json()["choices"][0]["message"]["content"]), COLOR_SCHEMA)
    assert ok_stream.status_code == 200 and ok_stream.text.endswith("data: [DONE]\n\n")
    for r, param in ((schema_err, "response_format"), (regex_err, "regex"),
                     (long_err, "messages")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert (err["param"] or "").startswith(param), err
    assert long_err.json()["error"]["code"] == "context_length_exceeded"
    assert "nonsense" in schema_err.json()["error"]["message"]


def test_disconnect_mid_stream_frees_the_request(server: ServerHandle) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(headers=auth(), timeout=120) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines: list[str] = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lines.append(line)
                if len(lines) >= 2:  # role chunk + first token: it is running
                    health = server.health()
                    assert health["num_running"] == 1 and health["num_inflight"] == 1, health
                    break  # leaving the stream closes the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        h = server.health()
        if h["num_running"] == 0 and h["num_inflight"] == 0 and \
                h["kv_free_pages"] == h["kv_total_pages"]:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r'structspec_requests_total\{finish_reason="abort"\} [1-9]', metrics)


def test_disconnect_non_stream_frees_the_request(server: ServerHandle) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=3)
    deadline = time.monotonic() + 30
    while True:
        h = server.health()
        if h["num_running"] == 0 and h["num_inflight"] == 0 and \
                h["kv_free_pages"] == h["kv_total_pages"]:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.2)


def test_metrics(server: ServerHandle) -> None:
    r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=60,
                   json={"model": MODEL, "prompt": "x", "regex": "(unclosed"})
    assert r.status_code == 400
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("structspec_requests_total", "structspec_time_to_first_token_seconds_bucket",
                 "structspec_e2e_request_latency_seconds_bucket",
                 "structspec_prompt_tokens_total", "structspec_generation_tokens_total",
                 "structspec_num_requests_running", "structspec_num_requests_waiting",
                 "structspec_num_requests_waiting_grammar",
                 "structspec_grammar_compile_seconds_count", "structspec_spec_accept_length",
                 "structspec_spec_accept_rate"):
        assert name in text, name
    assert re.search(r'structspec_requests_total\{finish_reason="rejected"\} [1-9]', text)
    assert not re.search(r"structspec_grammar_compile_seconds_count 0\.0", text)


@pytest.mark.parametrize("extra, param, fragment", [
    ({"json_schema": False}, "json_schema", "accepts no finite JSON value"),
    ({"json_schema": {"not": {}}}, "json_schema", "accepts no finite JSON value"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#"}},
                      "required": ["a"]}}, "json_schema", "no finite way out"),
    ({"regex": "\\q"}, "regex", "unknown escape"),
    ({"regex": "[^]"}, "regex", "empty character class"),
    # 3000 properties: over the engine's 2048, under the front end's --max-grammar-chars
    ({"json_schema": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(3000)}}}, "json_schema",
     "'properties' has 3000 entries"),
])
def test_grammars_with_no_output_or_over_a_limit_are_400s(
        server: ServerHandle, extra: dict[str, Any], param: str, fragment: str) -> None:
    """Issue 17: these used to be a 200 (or a 400 only after the 30 s compile limit)."""
    t = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert time.monotonic() - t < 10
    if "properties" in fragment:
        assert err["code"] == "grammar_too_complex"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}


def test_forced_tool_calls_follow_the_tools_schemas(client: openai.OpenAI) -> None:
    """The OpenAI client reads a named and a required call back as tool_calls whose
    arguments follow the tool's parameters (the real model, the grammar enforcing them)."""
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome", "Oslo") and set(args) <= {"city", "unit"}
    stream = list(client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0, tools=[WEATHER_TOOL],
        tool_choice="required", stream=True))
    calls = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls and all(tc.function.name == "get_weather" for tc in calls)
    assert all(json.loads(tc.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
               for tc in calls)
    assert stream[-1].choices[0].finish_reason == "tool_calls"


def test_tokenize_counts_the_chat_prompt_and_detokenize_inverts_it(
        server: ServerHandle, client: openai.OpenAI) -> None:
    """/tokenize of a chat counts what the chat endpoint reports as its prompt tokens (the
    real template and tokenizer); /detokenize turns a prompt's ids back into its text."""
    ask = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1,
                                          temperature=0, tools=[WEATHER_TOOL])
    r = httpx.post(server.url + "/tokenize", headers=auth(), timeout=30,
                   json={"model": MODEL, "messages": ask, "tools": [WEATHER_TOOL]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert chat.usage is not None and body["count"] == chat.usage.prompt_tokens
    assert body["max_model_len"] == 1024 and body["token_strs"] is None
    text = "Grüße, world! 🎉"
    ids = httpx.post(server.url + "/tokenize", headers=auth(), timeout=30,
                     json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = httpx.post(server.url + "/detokenize", headers=auth(), timeout=30, json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    r = httpx.post(server.url + "/detokenize", headers=auth(), timeout=30,
                   json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_truncated_prompt_and_token_id_logprobs(server: ServerHandle,
                                               client: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens (the answer is the kept tail's, which echo shows and
    usage counts) and return_tokens_as_token_ids (each "token_id:N" is the token whose text
    the plain logprobs show), with the real tokenizer and model."""
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    ids = httpx.post(server.url + "/tokenize", headers=auth(), timeout=30,
                     json={"prompt": prompt}).json()["tokens"]
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=3, temperature=0)
    cut = client.completions.create(prompt=prompt, echo=True, logprobs=1, extra_body={
        "truncate_prompt_tokens": 5}, **kw)
    tail = client.completions.create(prompt=ids[-5:], **kw)
    assert cut.usage is not None and cut.usage.prompt_tokens == 5 < len(ids)
    echo = httpx.post(server.url + "/detokenize", headers=auth(), timeout=30,
                      json={"tokens": ids[-5:]}).json()["prompt"]
    assert cut.choices[0].text == echo + tail.choices[0].text and not prompt.startswith(echo)
    as_ids = client.completions.create(prompt=ids[-5:], logprobs=1, extra_body={
        "return_tokens_as_token_ids": True}, **kw).choices[0].logprobs
    plain = cut.choices[0].logprobs
    assert as_ids is not None and plain is not None and as_ids.tokens and plain.tokens
    # echo + logprobs: the kept prompt's 5 tokens lead (the first unscored), then the answer's
    assert plain.token_logprobs is not None and plain.token_logprobs[0] is None
    assert "".join(plain.tokens[:5]) == echo
    plain.tokens, plain.token_logprobs = plain.tokens[5:], plain.token_logprobs[5:]
    for token, text in zip(as_ids.tokens, plain.tokens, strict=True):
        assert token.startswith("token_id:")
        r = httpx.post(server.url + "/detokenize", headers=auth(), timeout=30,
                       json={"tokens": [int(token.removeprefix("token_id:"))]})
        assert r.json()["prompt"] == text
    assert as_ids.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-4)


def test_engine_death_fails_requests_and_stops_the_server(server: ServerHandle) -> None:
    """Last test of the module: SIGKILL the engine process mid-request; the request fails
    with an error (not a hang) and, with no restart left (``--engine-restarts 0``), the
    server exits with code 1."""
    m = re.search(r"engine pid (\d+)", server.log_path.read_text())
    assert m, server.log_tail()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 500, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth(),
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    os.kill(int(m.group(1)), signal.SIGKILL)
            if len(events) > 600:
                break
    assert events[-1] == "[DONE]"
    assert "engine process exited" in json.loads(events[-2])["error"]["message"]
    assert server.proc.wait(30) == 1

