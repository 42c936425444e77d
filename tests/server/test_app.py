"""Protocol-level tests of the HTTP app against a fake engine (fast; no model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from structspec.server.app import create_app
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.server_fakes import FakeCodec, FakeEngine

MSGS = [{"role": "user", "content": "hi"}]


def make_client(engine: FakeEngine | None = None, api_key: str | None = None) -> TestClient:
    state = ServerState(engine=engine or FakeEngine(), codec=FakeCodec(),
                        metrics=ServerMetrics(), model_name="fake", api_key=api_key)
    return TestClient(create_app(state))


@pytest.fixture
def client() -> Iterator[TestClient]:
    with make_client() as c:
        yield c


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_stream(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello",
                                             "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
    assert u["speculative"]["verify_steps"] == 5


def test_stop_string_cut_and_never_streamed(client: TestClient) -> None:
    body = {"messages": MSGS, "stop": [" STOP", "zzz"], "max_tokens": 100}
    r = client.post("/v1/chat/completions", json=body)
    c = r.json()["choices"][0]
    assert c["message"]["content"] == "Hello world!"
    assert c["finish_reason"] == "stop" and c["stop_reason"] == " STOP"
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "Hello world!"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_skips_stop_strings_inside_them(client: TestClient) -> None:
    """``min_tokens``: the first " STOP" ends inside the first 20 tokens (one character each
    in the fake), so the engine and the front end cut at the second one, streamed or not."""
    script = "Hello world! STOP here. "
    body = {"messages": MSGS, "stop": [" STOP"], "max_tokens": 100, "min_tokens": 20}
    want = script + "Hello world!"
    c = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert (c["message"]["content"], c["stop_reason"]) == (want, " STOP")
    events = sse_events(client.post("/v1/chat/completions",
                                    json={**body, "stream": True}).text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == want
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "min_tokens": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def _chat_text(client: TestClient, body: dict[str, Any]) -> tuple[str, str]:
    """The content of ``body``'s answer, and of its streamed answer (pieces joined)."""
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return full, "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])


def test_include_stop_str_in_output_keeps_the_stop_string(client: TestClient) -> None:
    """The text ends after the stop string, streamed (nothing held back, nothing lost) or
    not; the engine gets the flag."""
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    body = {"messages": MSGS, "stop": [" STOP", "zzz"], "max_tokens": 100}
    cut, cut_streamed = _chat_text(client, body)
    assert cut == cut_streamed == "Hello world!"
    assert engine.added[-1][2].include_stop_str_in_output is False
    kept, kept_streamed = _chat_text(client, {**body, "include_stop_str_in_output": True})
    assert kept == kept_streamed == cut + " STOP"
    assert engine.added[-1][2].include_stop_str_in_output is True


def test_skip_special_tokens_false_keeps_them(client: TestClient) -> None:
    """``skip_special_tokens: false`` reaches the detokenizer (the fake's EOS reads
    ``</s>``); the EOS that ended the answer shows only with include_stop_str_in_output,
    as in vLLM."""
    from tests.server.server_fakes import EOS_TEXT

    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    body = {"messages": MSGS, "max_tokens": 10, "structured_outputs": {"choice": ["no", "yes"]}}
    assert _chat_text(client, body) == ("yes", "yes")
    assert engine.added[-1][2].skip_special_tokens is True
    assert _chat_text(client, {**body, "skip_special_tokens": False}) == ("yes", "yes")
    assert engine.added[-1][2].skip_special_tokens is False
    assert _chat_text(client, {**body, "skip_special_tokens": False,
                               "include_stop_str_in_output": True}) == ("yes" + EOS_TEXT,) * 2
    assert _chat_text(client, {**body, "include_stop_str_in_output": True}) == ("yes", "yes")


def test_stream_include_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-2])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_continuous_usage_stats(client: TestClient, path: str) -> None:
    """vLLM's continuous_usage_stats: each choice chunk has its choice's usage so far (per
    choice with n = 2), the last chunk the totals; without include_usage it changes nothing."""
    body = {"max_tokens": 3, "n": 2, "stream": True,
            **({"messages": MSGS} if "chat" in path else {"prompt": "hi"})}
    events = sse_events(client.post(path, json={**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}).text)
    assert events[-1] == "[DONE]"
    totals = events[-2]
    assert totals["choices"] == [] and totals["usage"]["completion_tokens"] == 6
    prompt = totals["usage"]["prompt_tokens"]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-2]:
        (choice,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == prompt
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        seen[choice["index"]].append(u["completion_tokens"])
    for counts in seen.values():  # per choice: growing, up to its 3 tokens
        assert counts == sorted(counts) and counts[-1] == 3 and counts[0] < 3
    plain = sse_events(client.post(path, json={**body, "stream_options": {
        "continuous_usage_stats": True}}).text)
    assert all("usage" not in e for e in plain[:-1])


def test_n_choices_get_seeds(client: TestClient) -> None:
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "n": 3,
                                                 "seed": 10, "temperature": 0.7})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert [p.seed for _, _, p in engine.added[-3:]] == [10, 11, 12]
    assert r.json()["usage"]["completion_tokens"] == 6


def test_chat_logprobs(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2,
                                                 "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["logprob"] == -0.1 and content[0]["bytes"] == [72]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["H", "?"]


def test_completions_text_and_token_prompts(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": ["ab", "AB"], "max_tokens": 2,
                                            "logprobs": 1, "echo": True})
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["abHe", "ABHe"]
    r = client.post("/v1/completions", json={"prompt": [[65, 66], [67]], "max_tokens": 1,
                                            "echo": True})
    assert [c["text"] for c in r.json()["choices"]] == ["ABH", "CH"]
    lp = body["choices"][0]["logprobs"]
    # echo: the prompt's tokens first (the first one unscored), as OpenAI's legacy API
    assert lp["tokens"] == ["a", "b", "H", "e"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"][0] is None
    assert body["usage"]["prompt_tokens"] == 4
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hell"


def test_schema_the_engine_cannot_serve_is_400_before_the_engine(client: TestClient) -> None:
    """A remote $ref and a schema too deep to send are refused by the front end (400 naming
    the field). The deep one used to overflow the pickling to the engine process and stall
    every later request; the remote one made the engine fetch the URL."""
    deep: dict = {}
    cur = deep
    for _ in range(300):
        cur["properties"] = {"a": {}}
        cur = cur["properties"]["a"]
    for schema, fragment in (({"$ref": "http://127.0.0.1:9/s.json"}, "not a local reference"),
                             (deep, "nests deeper than 128 levels")):
        body = {"messages": MSGS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema", err
        assert fragment in err["message"], err
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
    assert r.status_code == 200, r.text  # and the server goes on serving


def test_grammar_error_before_tokens_is_400(client: TestClient) -> None:
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "regex": "BAD(",
                                                     "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "missing ')'" in err["message"] and err["param"] == "regex"
        assert err["type"] == "invalid_request_error"


def test_oversize_prompt_is_immediate_400() -> None:
    engine = FakeEngine(max_model_len=50)
    with make_client(engine) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                              "content": "x" * 100}]})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "messages"
        assert engine.added == []


def test_bad_json_and_types_are_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b"{nope",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "n": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "top_k": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "unknown_field": 1,
                                                 "max_tokens": 1})
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"


BAD = "invalid_request_parameter"  # the generic 400 code of a refused field


@pytest.mark.parametrize(("messages", "param", "code"), [
    ("hi", "messages", BAD),
    ([], "messages", BAD),
    ([{"content": "x"}], "messages[0].role", BAD),
    ([{"role": 1, "content": "x"}], "messages[0].role", BAD),
    ([{"role": "robot", "content": "x"}], "messages[0].role", BAD),
    ([{"role": "system", "content": "x"}, {"role": "user"}], "messages[1].content", BAD),
    ([{"role": "user", "content": None}], "messages[0].content", BAD),
    ([{"role": "user", "content": 5}], "messages[0].content", BAD),
    ([{"role": "user", "content": [1, 2]}], "messages[0].content[0]", BAD),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
     "messages[0].content[0].text", BAD),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type", "unsupported"),
    ([MSGS[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}],
     "messages[1].tool_calls[0]", BAD),
])
def test_malformed_messages_are_400_naming_the_field(
        client: TestClient, messages: Any, param: str, code: str | None) -> None:
    """Checked by the same function as the Python API and the CLI, before the template: a
    missing or null user content is refused (it used to render as ""), as is an assistant
    tool-call turn whose call has no function. The code is the Python API's for the same refusal
    (``invalid_request_parameter``, or the check's own ``unsupported``)."""
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code
    assert err["message"].startswith(f"{param}: ") and err["type"] == "invalid_request_error"
    assert engine.added == []


def test_text_content_parts_are_joined(client: TestClient) -> None:
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": "be"}, {"role": "user", "content": parts}],
        "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert "".join(map(chr, engine.added[-1][1])) == "<system>be\n<user>hi\n<assistant>"


def test_api_key() -> None:
    with make_client(api_key="sekrit") as c:
        r = c.post("/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake"
        assert c.get("/health").status_code == 200  # health/metrics stay open


def test_not_ready_is_503() -> None:
    with make_client(FakeEngine(ready=False)) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_metrics_text(client: TestClient) -> None:
    client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    client.post("/v1/chat/completions", json={"messages": MSGS, "regex": "BAD("})
    text = client.get("/metrics").text
    assert 'structspec_requests_total{finish_reason="length"} 1.0' in text
    assert 'structspec_requests_total{finish_reason="rejected"} 1.0' in text
    assert "structspec_time_to_first_token_seconds_count 1.0" in text
    assert "structspec_spec_accept_length " in text
    assert "structspec_num_requests_running" in text


def test_openai_sdk_against_fake(client: TestClient) -> None:
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    done = oai.beta.chat.completions.parse if hasattr(oai, "beta") and hasattr(
        oai.beta, "chat") else oai.chat.completions.parse
    out = done(model="fake", messages=MSGS, response_format=Person, max_tokens=50)
    assert out.choices[0].message.parsed == Person(name="Ada", age=36)
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    g = engine.added[-1][2].grammar
    assert g.strict is True and g.schema["additionalProperties"] is False  # type: ignore[union-attr]
    chunks = list(oai.chat.completions.create(model="fake", messages=MSGS, max_tokens=4,
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hell"
    comp = oai.completions.create(model="fake", prompt="x", max_tokens=3)
    assert comp.choices[0].text == "Hel"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="fake", messages=MSGS,
                                    extra_body={"regex": "BAD("})
    assert "missing ')'" in str(e.value)


def test_max_tokens_beyond_context_is_400_not_clamped() -> None:
    engine = FakeEngine(max_model_len=50)
    prompt_len = len(FakeCodec().encode_chat(MSGS))  # one token per character
    room = 50 - prompt_len
    with make_client(engine) as c:
        for field in ("max_tokens", "max_completion_tokens"):
            r = c.post("/v1/chat/completions", json={"messages": MSGS, field: room})
            assert r.status_code == 200, r.text  # prompt + max_tokens == max_model_len fits
            assert engine.added[-1][2].max_tokens == room
            for asked in (room + 1, 10**9):
                n_added = len(engine.added)
                for stream in (False, True):
                    r = c.post("/v1/chat/completions", json={"messages": MSGS, field: asked,
                                                             "stream": stream})
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err == {
                        "message": "This model's maximum context length is 50 tokens. However, "
                                   f"you requested {prompt_len + asked} tokens ({prompt_len} in "
                                   f"the messages, {asked} in the completion). Please reduce the "
                                   "length of the messages or completion.",
                        "type": "invalid_request_error", "param": field,
                        "code": "context_length_exceeded"}
                assert len(engine.added) == n_added  # never reached the engine
        # left out: still the rest of the context (capped), not an error
        r = c.post("/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 200, r.text
        assert engine.added[-1][2].max_tokens == room
        # completions: each prompt is checked on its own length
        r = c.post("/v1/completions", json={"prompt": ["a" * 40, "b" * 45], "max_tokens": 5})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": ["a" * 40, "b" * 46], "max_tokens": 5})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
        assert "you requested 51 tokens (46 in the prompt, 5 in the completion)" in err["message"]


def test_unknown_model_is_404(client: TestClient) -> None:
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    expected = {"message": "The model `gpt-4o` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404}
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MSGS,
                                                     "max_tokens": 2, "stream": stream})
        assert r.status_code == 404, r.text
        assert r.json() == {"error": expected}
        r = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x",
                                                "max_tokens": 2, "stream": stream})
        assert r.status_code == 404, r.text
        assert r.json() == {"error": expected}
    assert engine.added == []
    # the served name, or none (left out / null / ""), is the served model
    for extra in ({"model": "fake"}, {}, {"model": None}, {"model": ""}):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "fake"
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
    assert 'structspec_http_errors_total{status="404"} 4.0' in client.get("/metrics").text


def test_openai_sdk_errors_for_model_and_max_tokens(client: TestClient) -> None:
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        oai.chat.completions.create(model="nope", messages=MSGS, max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        oai.completions.create(model="fake", prompt="x", max_tokens=10**9)
    assert br.value.param == "max_tokens" and br.value.code == "context_length_exceeded"


class _CheckingCodec(FakeCodec):
    """The real codec's input checks on the fake's one-token-per-character encoding."""

    @staticmethod
    def _check(text: str, max_tokens: int | None) -> None:
        from structspec.core import PromptTooLongError

        text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, a ValueError
        if max_tokens is not None and len(text) > max_tokens:
            raise PromptTooLongError(len(text), max_tokens)

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None,
                    options: Any = None) -> list[int]:
        ids = super().encode_chat(messages, tools, options=options)
        self._check("".join(map(chr, ids)), max_tokens)
        return ids

    def encode_text(self, text: str, max_tokens: int | None = None) -> list[int]:
        self._check(text, max_tokens)
        return super().encode_text(text)


def test_prompts_refused_by_the_codec_are_400s() -> None:
    """A prompt the codec refuses untokenized is the usual context_length_exceeded 400 with
    a lower bound; text that is not valid Unicode is a 400 naming its field (it was a 500)."""
    engine = FakeEngine(max_model_len=50)
    state = ServerState(engine=engine, codec=_CheckingCodec(), metrics=ServerMetrics(),
                        model_name="fake")
    with TestClient(create_app(state)) as c:
        r = c.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x" * 80}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "your prompt has at least" in err["message"]
        r = c.post("/v1/completions", json={"prompt": ["ok", "y" * 60]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
        r = c.post("/v1/completions", content=b'{"prompt": "a\\ud800b", "max_tokens": 2}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert "surrogate" in r.json()["error"]["message"]
        assert engine.added == []  # nothing refused reached the engine
        r = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert [a[1] for a in engine.added] == [[ord(ch) for ch in "fine"]]


def post_raw(client: TestClient, path: str, raw: str) -> Any:
    """POST ``raw`` as a JSON body; the response."""
    return client.post(path, content=raw.encode(), headers={"content-type": "application/json"})


CHAT_HEAD = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '


@pytest.mark.parametrize("path,raw,param,words", [
    # an integer literal over Python's 4300-digit limit: the field holding it is named
    ("/v1/chat/completions", CHAT_HEAD + '"seed": ' + "1" * 5000 + "}", "seed",
     "integer literal of 5000 digits exceeds the limit of 4300 digits"),
    ("/v1/chat/completions", CHAT_HEAD + '"json_schema": {"properties": {"a": {"maximum": -'
     + "9" * 4400 + "}}}}", "json_schema.properties.a.maximum", "4400 digits"),
    ("/v1/completions", '{"prompt": [1, ' + "2" * 5000 + "]}", "prompt[1]", "5000 digits"),
    # nesting past the recursion limit: no field can be named
    ("/v1/chat/completions", CHAT_HEAD + '"foo": ' + "[" * 100_000 + "]" * 100_000 + "}", None,
     "the request body nests arrays/objects too deeply"),
    ("/v1/completions", '{"prompt": "x", "foo": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001,
     None, "too deeply"),
], ids=["huge-seed", "huge-int-in-schema", "huge-token-id", "deep-chat", "deep-completion"])
def test_json_python_refuses_is_400_not_500(client: TestClient, path: str, raw: str,
                                            param: str | None, words: str) -> None:
    """Valid JSON that ``json.loads`` refuses (digit limit, recursion) is the client's input:
    a 400 naming the field where there is one, never a 500."""
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    r = post_raw(client, path, raw)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err
    assert engine.added == []


@pytest.mark.parametrize("text,words", [
    ('{"type": "integer", "maximum": ' + "7" * 4400 + "}",
     "integer literal of 4400 digits exceeds the limit of 4300 digits (at /maximum)"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests arrays/objects too deeply"),
    ("{nope", "is not valid JSON"),
], ids=["huge-int", "deep", "not-json"])
@pytest.mark.parametrize("field", ["json_schema", "guided_json"])
def test_schema_string_python_refuses_is_400(client: TestClient, field: str, text: str,
                                            words: str) -> None:
    """A JSON Schema sent as a JSON *string* is parsed by the server: the same refusals are a
    400 naming the field."""
    r = client.post("/v1/chat/completions", json={"messages": MSGS, field: text})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert words in err["message"] and err["message"].startswith(field), err


@pytest.mark.parametrize("path,base", [
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
])
@pytest.mark.parametrize("field,value", [
    ("temperature", "0.5"), ("temperature", True), ("top_p", "1"), ("min_p", False),
    ("stream", "yes"), ("stream", 1), ("ignore_eos", "true"),
    ("include_stop_str_in_output", "true"), ("include_stop_str_in_output", 1),
    ("skip_special_tokens", "false"), ("skip_special_tokens", 0),
])
def test_wrong_scalar_types_are_400_over_http(client: TestClient, path: str,
                                              base: dict[str, Any], field: str,
                                              value: Any) -> None:
    """README: "a known field with the wrong type is a 400 naming it" -- no coercion of
    strings or booleans to numbers, nor of strings or numbers to booleans (a ``"stream":
    "yes"`` used to stream)."""
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    r = client.post(path, json={**base, field: value})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert err["message"].startswith(f"invalid value for '{field}': Input should be a valid "), err
    assert engine.added == []
    r = client.post(path, json={**base, "temperature": 1, "top_p": 1})  # JSON ints are numbers
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].temperature == 1.0


def test_fake_engine_grammar_params_match_the_engine() -> None:
    """The fake's kind -> param table and the front end's copy are the grammar layer's."""
    from structspec.grammar.errors import PARAM_BY_KIND
    from structspec.server.generation import GRAMMAR_KIND_PARAMS
    from tests.server.server_fakes import ENGINE_GRAMMAR_PARAM

    assert ENGINE_GRAMMAR_PARAM == PARAM_BY_KIND
    assert GRAMMAR_KIND_PARAMS == frozenset(PARAM_BY_KIND.values())


BAD_SCHEMA = {"type": "object", "properties": {"a": {"pattern": "BAD("}}}


@pytest.mark.parametrize("body,param", [
    # the engine says param='regex' / 'ebnf' / 'choice' / 'json_schema' by
    # grammar kind; the error must name the field the client actually sent
    ({"response_format": {"type": "regex", "regex": "BAD("}}, "response_format.regex"),
    ({"response_format": {"type": "regex", "pattern": "BAD("}}, "response_format.pattern"),
    ({"response_format": {"type": "ebnf", "ebnf": "root ::= BAD("}}, "response_format.ebnf"),
    ({"response_format": {"type": "gbnf", "grammar": "root ::= BAD("}},
     "response_format.grammar"),
    ({"response_format": {"type": "choice", "choices": ["BAD("]}}, "response_format.choices"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": BAD_SCHEMA}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json", "schema": BAD_SCHEMA}}, "response_format.schema"),
    ({"json_schema": BAD_SCHEMA}, "json_schema"),
    ({"json_schema": json.dumps(BAD_SCHEMA)}, "json_schema"),
    ({"guided_json": BAD_SCHEMA}, "guided_json"),
    ({"regex": "BAD("}, "regex"),
    ({"guided_regex": "BAD("}, "guided_regex"),
    ({"grammar": "root ::= BAD("}, "grammar"),
    ({"guided_grammar": "root ::= BAD("}, "guided_grammar"),
    ({"guided_choice": ["ok", "BAD("]}, "guided_choice"),
    ({"structured_outputs": {"regex": "BAD("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= BAD("}}, "structured_outputs.grammar"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_grammar_error_names_the_field_sent(client: TestClient, body: dict[str, Any],
                                           param: str, path: str, stream: bool) -> None:
    base: dict[str, Any] = {"messages": MSGS} if "chat" in path else {"prompt": "x"}
    r = client.post(path, json={**base, **body, "stream": stream, "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "missing ')'" in err["message"], err
    assert err["param"] == param, err


@pytest.mark.parametrize("top_logprobs", [21, -1])
def test_chat_top_logprobs_range_names_top_logprobs(client: TestClient,
                                                   top_logprobs: int) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": True,
                                                 "top_logprobs": top_logprobs})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "top_logprobs", err
    assert err["message"] == f"top_logprobs must be between 0 and 20, got {top_logprobs}"
    # completions' own field is 'logprobs'
    r = client.post("/v1/completions", json={"prompt": "x", "logprobs": top_logprobs})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs", err
    assert err["message"] == f"logprobs must be between 0 and 20, got {top_logprobs}"


def test_client_disconnect_mid_body_is_499_not_500() -> None:
    """A client that hangs up before its request body arrived is counted under 499 (nginx's
    "client closed request"), not as a server error, and the app keeps serving."""
    import asyncio

    state = ServerState(engine=FakeEngine(), codec=FakeCodec(), metrics=ServerMetrics(),
                        model_name="fake", api_key=None)
    app = create_app(state)
    incoming = [{"type": "http.request", "body": b'{"model": "fa', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    metrics = state.metrics.render().decode()
    assert 'http_errors_total{status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics
    with TestClient(app) as client:  # the next request is served as usual
        assert client.post("/v1/chat/completions",
                           json={"model": "fake", "messages": MSGS}).status_code == 200


def test_usage_reports_cached_prompt_tokens() -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: per prompt the reused tokens
    (not multiplied by ``n``), 0 without a hit."""
    engine = FakeEngine()
    with make_client(engine) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        engine.cached_tokens = 16
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "n": 2})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
        r = c.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
