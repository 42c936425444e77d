"""Auto tool calls in the Hermes format (``--tool-call-parser hermes``,
server/hermes_tools.py, server/hermes_stream.py): the structural tag each request asks for,
the answer read back (plain and streamed alike), the refusals, and the parser off. The fake
engine writes a Hermes call of the first tool for such a tag, or ``engine.script``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.constraints import StructuralTagConstraint
from structspec.server.hermes_stream import HermesStream
from structspec.server.hermes_tools import call_begin, parse_hermes
from tests.server.fake_client import CHAT, MSGS, fake_client
from tests.server.server_fakes import FakeEngine
from tests.server.test_app import sse_events
from tests.server.test_tool_calls import TOOLS, WEATHER


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    """The app with ``--tool-call-parser hermes``."""
    with fake_client(engine, tool_call_parser="hermes") as c:
        yield c


def _chat(client: TestClient, **body: Any) -> Any:
    return client.post(CHAT, json={"messages": MSGS, "max_tokens": 200, "tools": TOOLS, **body})


def _call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}\n</tool_call>'


def _streamed(client: TestClient, **body: Any) -> dict[str, Any]:
    """A streamed answer put back together: content, tool_calls, finish_reason, and the
    tool-call deltas as sent."""
    events = sse_events(_chat(client, stream=True, **body).text)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["delta"] for c in choices[1:]]
    content = "".join(d.get("content") or "" for d in deltas)
    parts = [p for d in deltas for p in d.get("tool_calls", [])]
    calls: dict[int, dict[str, Any]] = {}
    for p in parts:
        call = calls.setdefault(p["index"], {"function": {"name": "", "arguments": ""}})
        call.update({k: p[k] for k in ("id", "type") if k in p})
        call["function"]["name"] += p["function"].get("name", "")
        call["function"]["arguments"] += p["function"].get("arguments", "")
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": choices[-1]["finish_reason"], "parts": parts}


def _same_answer(client: TestClient, **body: Any) -> dict[str, Any]:
    """The plain answer's choice, checked equal to the streamed one (ids aside)."""
    choice = _chat(client, **body).json()["choices"][0]
    streamed = _streamed(client, **body)
    message = choice["message"]
    assert streamed["content"] == message["content"]
    assert [c["function"] for c in streamed["tool_calls"]] == [
        c["function"] for c in message.get("tool_calls", [])]
    assert streamed["finish_reason"] == choice["finish_reason"]
    for c in [*streamed["tool_calls"], *message.get("tool_calls", [])]:
        assert c["id"].startswith("call_") and c["type"] == "function"
    return choice


def test_the_grammar_is_a_hermes_structural_tag_of_the_tools(client: TestClient,
                                                            engine: FakeEngine) -> None:
    for choice in ("auto", None):
        r = _chat(client, **({"tool_choice": choice} if choice else {}))
        assert r.status_code == 200, r.text
        grammar = engine.added[-1][2].grammar
        assert isinstance(grammar, StructuralTagConstraint)
        assert grammar.strict is False  # get_weather is not strict: best effort
        tag = grammar.parsed_tag()
        assert tag["triggers"] == ["<tool_call>"]
        assert tag["structures"] == [
            {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER,
             "end": "}\n</tool_call>"},
            {"begin": '<tool_call>\n{"name": "get_time", "arguments": ',
             "schema": {"type": "object", "properties": {"zone": {"type": "string"}}},
             "end": "}\n</tool_call>"}]
    # every tool strict: a strict tag; a tool without parameters: an open object schema
    _chat(client, tools=[TOOLS[1], {"type": "function", "function": {
        "name": 'say "hi"', "strict": True}}])
    grammar = engine.added[-1][2].grammar
    assert grammar.strict is True
    second = grammar.parsed_tag()["structures"][1]
    assert second["begin"] == '<tool_call>\n{"name": "say \\"hi\\"", "arguments": '
    assert second["schema"] == {"type": "object", "properties": {}}


def test_one_call_after_text(client: TestClient) -> None:
    choice = _same_answer(client)
    assert choice["message"]["content"] == "Let me check. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"


def test_several_calls_stream_each_as_its_section_closes(client: TestClient,
                                                         engine: FakeEngine) -> None:
    engine.script = (_call("get_weather", {"city": "Oslo"}) + "\n"
                     + _call("get_time", {"zone": "CET"}) + "\n")
    choice = _same_answer(client)
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert choice["finish_reason"] == "tool_calls"
    parts = _streamed(client)["parts"]  # id and name, then the arguments, per call
    assert [sorted(p) for p in parts] == [["function", "id", "index", "type"],
                                          ["function", "index"]] * 2
    assert [p["index"] for p in parts] == [0, 0, 1, 1]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}


def test_a_closing_tag_inside_a_json_string_does_not_end_the_call(client: TestClient,
                                                                   engine: FakeEngine) -> None:
    """``</tool_call>`` in an argument's value or in a tool's name is text of the call: the
    section ends at the ``</tool_call>`` after which its body reads as a call (it used to end
    at the first one, and the call came back as a broken text answer)."""
    engine.script = (_call("get_weather", {"city": "Par</tool_call>is <tool_call>"})
                     + _call("get</tool_call>time", {"zone": "CET"}))
    choice = _same_answer(client)
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Par</tool_call>is <tool_call>"}'},
        {"name": "get</tool_call>time", "arguments": '{"zone": "CET"}'}]
    assert choice["finish_reason"] == "tool_calls"


def test_a_text_answer_has_no_calls(client: TestClient, engine: FakeEngine) -> None:
    engine.script = "Paris is sunny <tool_ today."  # a partial tag held back, then sent
    choice = _same_answer(client)
    assert choice["message"]["content"] == engine.script
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_stays_text(client: TestClient, engine: FakeEngine) -> None:
    engine.script = "Sure. " + _call("get_weather", {"city": "Oslo"}) + _call(
        "get_time", {"zone": "UTC"})
    cut = len(engine.script) - 10
    choice = _same_answer(client, max_tokens=cut)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Sure. " + engine.script[len(
        "Sure. " + _call("get_weather", {"city": "Oslo"})):cut]
    (call,) = choice["message"]["tool_calls"]  # the complete one is still reported
    assert call["function"]["name"] == "get_weather"
    # only a cut call: text, no calls
    choice = _same_answer(client, max_tokens=20)
    assert choice["message"]["content"] == engine.script[:20]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_object"}}, "tools"),
    ({"tool_choice": "auto", "regex": "a+"}, "tools"),
    ({"guided_json": {"type": "object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}]},
     "tools[0].function.parameters"),
])
def test_bad_auto_requests_are_400_naming_the_field(client: TestClient, engine: FakeEngine,
                                                    body: dict[str, Any], param: str) -> None:
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    assert engine.added == []


def test_none_and_no_tools_and_forced_calls_are_as_before(client: TestClient,
                                                         engine: FakeEngine) -> None:
    r = _chat(client, tool_choice="none", max_tokens=4)
    assert r.json()["choices"][0]["message"]["content"] == "Hell"
    assert engine.added[-1][2].grammar is None
    r = _chat(client, tool_choice="none", response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 4})
    assert r.status_code == 200 and engine.added[-1][2].grammar is None
    r = _chat(client, tool_choice="required")
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert engine.added[-1][2].grammar.kind == "json_schema"


def test_parser_off_leaves_auto_as_text(engine: FakeEngine) -> None:
    with fake_client(engine) as plain:
        r = _chat(plain, tool_choice="auto", max_tokens=4)
        assert r.json()["choices"][0]["message"]["content"] == "Hell"
        assert engine.added[-1][2].grammar is None
        r = _chat(plain, response_format={"type": "json_object"})
        assert r.status_code == 200


def test_stream_and_parse_agree_whatever_the_chunking() -> None:
    text = ("  Hm. " + _call("get_weather", {"city": "Oslo"}) + " between "
            + '<tool_call>\n{"name": 3}\n</tool_call>' + _call("get_time", {}) + "<tool_c")
    for cut in range(len(text) + 1):
        for step in (1, 4, 9):
            part, stream = text[:cut], HermesStream()
            deltas = [d for i in range(0, max(len(part), 1), step)
                      for d in stream.feed(part[i:i + step], i + step >= len(part))]
            parsed = parse_hermes(part)
            content = "".join(d.get("content", "") for d in deltas)
            assert content == (parsed.content if parsed.content.strip() else ""), (cut, step)
            args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
                    if "tool_calls" in d and "id" not in d["tool_calls"][0]]
            assert args == [c.arguments for c in parsed.calls], (cut, step)


def test_begin_escapes_the_name() -> None:
    assert call_begin('a"b\\c') == '<tool_call>\n{"name": "a\\"b\\\\c", "arguments": '


def test_an_engine_refusal_inside_the_tag_names_the_tools_parameters(client: TestClient) -> None:
    """A strict tool whose schema the grammar cannot enforce exactly is refused by the
    engine's check of the tag; the 400 names that tool's parameters, not the tag's place."""
    schema = {"type": "object", "$defs": {"s": {"type": "string"}},
              "properties": {"a": {"type": "string", "$ref": "#/$defs/s"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "strict": True,
                                                         "parameters": schema}}]
    # every tool strict (else best effort lets it through)
    tools[0] = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}
    r = _chat(client, tools=tools)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1].function.parameters"


def test_bounded_numbers_and_logprobs(client: TestClient, engine: FakeEngine) -> None:
    r = _chat(client, structured_outputs={"bounded_numbers": False})
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].grammar.bounded_numbers is False
    events = sse_events(_chat(client, stream=True, logprobs=True).text)
    entries = [t for e in events[1:-1] for t in ((e["choices"][0]["logprobs"] or {})
                                                 .get("content") or [])]
    # every generated character's entry is sent once (the EOS has no text)
    assert "".join(t["token"] for t in entries) == (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>')
    # logprobs of held-back text wait for the next delta: no logprobs-only chunk with an
    # empty delta before the finish (vLLM drops those), and far fewer chunks than tokens
    choices = [e["choices"][0] for e in events[1:-1] if e["choices"]]
    body = [ch for ch in choices if ch["finish_reason"] is None]
    assert all(ch["delta"] for ch in body[:-1]), body
    assert len(body) < len(entries) / 4


def test_the_serve_flag() -> None:
    from structspec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).tool_call_parser is None
    assert parser.parse_args(["serve", "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "mistral"])


def test_history_calls_are_shown_in_the_format_the_model_writes(client: TestClient,
                                                                engine: FakeEngine) -> None:
    """With the parser on, an earlier assistant turn's ``tool_calls`` reach the template as
    the ``<tool_call>`` sections the grammar makes the model write (a JSON array there taught
    the model to answer with an array, which is no call); ``/tokenize`` counts the same."""
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And Oslo?"}]
    assert _chat(client, messages=history).status_code == 200
    prompt = "".join(map(chr, engine.added[-1][1]))  # the fake codec: one id per character
    assert ('<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n') in prompt
    count = client.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["count"]
    assert count == len(engine.added[-1][1])


def test_no_parallel_calls_ends_the_grammar_after_the_first(client: TestClient,
                                                           engine: FakeEngine) -> None:
    """``parallel_tool_calls: false``: the same tools in xgrammar's current form, with
    ``stop_after_first`` (the grammar ends after one call); a bad schema there is still
    named as the tool's parameters."""
    r = _chat(client, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    tag = engine.added[-1][2].grammar.parsed_tag()
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["type"] == "triggered_tags"
    assert fmt["stop_after_first"] is True and fmt["triggers"] == ["<tool_call>"]
    assert [(t["begin"], t["content"]["json_schema"], t["end"]) for t in fmt["tags"]] == [
        (call_begin("get_weather"), WEATHER, "}\n</tool_call>"),
        (call_begin("get_time"), {"type": "object", "properties": {"zone": {"type": "string"}}},
         "}\n</tool_call>")]
    r = _chat(client, parallel_tool_calls=False, tools=[TOOLS[0], {
        "type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.parameters"
    r = _chat(client, parallel_tool_calls=True)
    assert "structures" in engine.added[-1][2].grammar.parsed_tag()


def test_tool_place_reads_both_forms() -> None:
    from structspec.server.hermes_tools import tool_place

    assert tool_place("structures[2].schema.properties.a") == \
        "tools[2].function.parameters.properties.a"
    assert tool_place("format.tags[1].content.json_schema") == "tools[1].function.parameters"
    assert tool_place("format.tags[1].begin") == tool_place("triggers[0]") == "tools"
