"""Forced tool calls (``tool_choice`` named / ``required``): the grammar each asks for, the
``tool_calls`` of the answer (plain and streamed), the refusals, and tool-call turns of the
history (server/tool_calls.py). The fake engine writes the schema's example for a named call
and one call of the first tool for ``required``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from structspec.constraints import JsonSchemaConstraint
from structspec.server.tool_calls import calls_from_output, history_message, plan_tool_calls
from tests.server.fake_client import CHAT, MSGS
from tests.server.server_fakes import FakeEngine
from tests.server.test_app import sse_events

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "strict": True,
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string"}}}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(client: TestClient, **body: Any) -> Any:
    return client.post(CHAT, json={"messages": MSGS, "max_tokens": 64, "tools": TOOLS, **body})


def test_named_call_generates_the_tools_arguments(client: TestClient,
                                                  engine: FakeEngine) -> None:
    r = _chat(client, tool_choice=NAMED)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    grammar = engine.added[-1][2].grammar
    assert isinstance(grammar, JsonSchemaConstraint) and grammar.schema == WEATHER
    assert grammar.strict is False  # OpenAI's default for function.strict
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather",
                                "arguments": json.dumps({"name": "Ada", "age": 36})}
    assert choice["finish_reason"] == "tool_calls"
    # a strict tool asks for strict enforcement
    _chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert engine.added[-1][2].grammar.strict is True


def test_named_call_streams_its_id_and_name_then_the_arguments(client: TestClient) -> None:
    r = _chat(client, tool_choice=NAMED, stream=True)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": None}
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert all(c["index"] == 0 for c in calls)
    assert "".join(c["function"]["arguments"] for c in calls) == json.dumps(
        {"name": "Ada", "age": 36})
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_required_generates_an_array_of_calls(client: TestClient, engine: FakeEngine) -> None:
    r = _chat(client, tool_choice="required")
    choice = r.json()["choices"][0]
    schema = engine.added[-1][2].grammar.schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert engine.added[-1][2].grammar.strict is False  # not every tool is strict
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    _chat(client, tool_choice="required", parallel_tool_calls=False)
    assert engine.added[-1][2].grammar.schema["maxItems"] == 1
    # streamed: the calls whole, once the array is complete
    events = sse_events(_chat(client, tool_choice="required", stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    with_calls = [d for d in deltas if "tool_calls" in d]
    assert len(with_calls) == 1 and with_calls[0]["tool_calls"][0]["index"] == 0
    assert with_calls[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not any(d.get("content") for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_cut_by_max_tokens_comes_back_as_text(client: TestClient) -> None:
    choice = _chat(client, tool_choice="required", max_tokens=5).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == '[{"na' and "tool_calls" not in choice["message"]


def test_required_schema_accepts_exactly_calls_of_the_tools() -> None:
    plan = plan_tool_calls(TOOLS, "required")
    assert plan is not None
    schema = plan.grammar.schema
    ok = [[{"name": "get_weather", "parameters": {"city": "Oslo"}}],
          [{"name": "get_time", "parameters": {}}, {"name": "get_weather",
                                                   "parameters": {"city": "x"}}]]
    bad = [[], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
           [{"name": "get_time"}], [{"name": "get_time", "parameters": {}, "x": 1}]]
    for value in ok:
        jsonschema.validate(value, schema)
    for value in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value), value
    calls = calls_from_output(plan, json.dumps(ok[1]))
    assert [c["function"]["name"] for c in calls or []] == ["get_time", "get_weather"]
    assert calls_from_output(plan, '[{"name": "get_time"') is None


def test_required_keeps_the_tools_own_refs() -> None:
    """Under ``required`` each tool's schema sits below the array: its local ``$ref``s (the
    root, ``$defs``, draft-07 ``definitions``, a property) are rebased and resolve as before;
    a ``$ref`` inside a data keyword (``const``) is data and stays."""
    chain = {"type": "object", "required": ["name", "next"], "additionalProperties": False,
             "properties": {"name": {"type": "string"},
                            "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
                            "p": {"$ref": "#/$defs/P"}, "q": {"$ref": "#/definitions/Q"},
                            "r": {"$ref": "#/properties/name"},
                            "c": {"const": {"$ref": "#/x"}}},
             "$defs": {"P": {"type": "integer"}}, "definitions": {"Q": {"type": "boolean"}}}
    other = {"type": "object", "properties": {"z": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "chain", "parameters": chain}},
             {"type": "function", "function": {"name": "other", "parameters": other}}]
    for used in (tools, tools[:1]):
        plan = plan_tool_calls(used, "required")
        assert plan is not None
        validator = jsonschema.Draft202012Validator(plan.grammar.schema)
        good = {"name": "a", "next": {"name": "b", "next": None}, "p": 3, "q": True,
                "r": "x", "c": {"$ref": "#/x"}}
        assert validator.is_valid([{"name": "chain", "parameters": good}])
        for bad in ({**good, "next": [{"name": "chain", "parameters": {}}]},
                    {**good, "next": {"name": "b", "next": 5}}, {**good, "p": "3"},
                    {**good, "q": 1}, {**good, "r": 5}, {**good, "c": {"$ref": "#/y"}}):
            assert not validator.is_valid([{"name": "chain", "parameters": bad}]), bad
            assert not jsonschema.Draft202012Validator(chain).is_valid(bad)


def test_a_stop_string_cut_is_not_reported_as_finished_calls(client: TestClient) -> None:
    choice = _chat(client, tool_choice=NAMED, stop=[","]).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ","
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"name": "Ada"'


def test_bounded_numbers_applies_to_the_tools_schema(client: TestClient,
                                                     engine: FakeEngine) -> None:
    r = _chat(client, tool_choice=NAMED, structured_outputs={"bounded_numbers": False})
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].grammar.bounded_numbers is False


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": "auto", "tools": []}, "tool_choice"),  # vLLM / OpenAI: tools must be set
    ({"tool_choice": "auto", "tools": None}, "tool_choice"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required", "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameter": WEATHER}}]}, "tools[0].function.parameter"),
    ({"tools": [{"type": "function", "parameters": WEATHER, "function": {"name": "f"}}]},
     "tools[0].parameters"),  # checked with tool_choice auto too: the template reads them
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}, "x": 1}},
     "tool_choice.x"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]},
     "tools[2].function.name"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
] + [
    # too deep, with auto too (was refused naming "messages", from the chat template)
    ({"tool_choice": choice, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _deep_schema(100)}}]}, "tools[0].function.parameters")
    for choice in ("auto", "required")
])
def test_bad_tool_requests_are_400_naming_the_field(client: TestClient, engine: FakeEngine,
                                                    body: dict[str, Any], param: str) -> None:
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine.added == []


def test_parameters_without_a_type_generate_an_object(client: TestClient,
                                                       engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}]
    _chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert engine.added[-1][2].grammar.schema == {"type": "object",
                                                  "properties": {"a": {"type": "integer"}}}


def test_auto_and_none_force_nothing(client: TestClient, engine: FakeEngine) -> None:
    for choice in ("auto", "none", None):
        r = _chat(client, tool_choice=choice, max_tokens=4)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert engine.added[-1][2].grammar is None


def test_a_tool_call_turn_of_the_history_is_shown_to_the_model(client: TestClient,
                                                               engine: FakeEngine) -> None:
    messages = [*MSGS,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 4, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = "".join(chr(t) for t in engine.added[-1][1])
    assert '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]' in prompt
    assert "<tool>12 C" in prompt


def test_a_turn_with_text_and_tool_calls_keeps_both(client: TestClient,
                                                    engine: FakeEngine) -> None:
    messages = [*MSGS, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "noon"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    prompt = "".join(chr(t) for t in engine.added[-1][1])
    assert 'Let me check.\n[{"name": "get_time", "arguments": {}}]' in prompt


def test_required_with_several_tools_compiles_their_refs() -> None:
    """Each tool's schema sits in the root ``$defs``: its rebased pointers go through object
    keys only, which xgrammar follows (an array index such as ``#/items/anyOf/0`` it does
    not), and a property named like a data keyword still holds a schema."""
    import xgrammar as xgr

    a = {"type": "object", "$defs": {"P": {"type": "integer"}},
         "properties": {"p": {"$ref": "#/$defs/P"},
                        "enum": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
         "required": ["p", "enum"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "a", "parameters": a}},
             {"type": "function", "function": {"name": "b"}}]
    plan = plan_tool_calls(tools, "required")
    assert plan is not None
    xgr.Grammar.from_json_schema(json.dumps(plan.grammar.schema))  # raises when a ref fails
    validator = jsonschema.Draft202012Validator(plan.grammar.schema)
    good = {"p": 1, "enum": {"p": 2, "enum": None}}
    assert validator.is_valid([{"name": "a", "parameters": good}, {"name": "b",
                                                                   "parameters": {}}])
    nested_call = {"p": 1, "enum": [{"name": "a", "parameters": {"p": 2, "enum": None}}]}
    assert not validator.is_valid([{"name": "a", "parameters": nested_call}])
    assert not jsonschema.Draft202012Validator(a).is_valid(nested_call)


def test_output_or_history_nested_past_the_json_parser_is_text(client: TestClient) -> None:
    plan = plan_tool_calls(TOOLS, "required")
    assert plan is not None and calls_from_output(plan, "[" * 5000 + "]" * 5000) is None
    deep = "[" * 3000 + "]" * 3000
    messages = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": deep}}]}]
    shown = history_message(messages[1], 1)
    assert shown["content"] == json.dumps([{"name": "f", "arguments": deep}])
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2})
    # a long prompt for the fake's 512-token context: refused as one, not a 500
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}},
     "messages[1].content"),
])
def test_tool_calls_where_they_cannot_be_read_are_400(client: TestClient, engine: FakeEngine,
                                                      message: dict[str, Any],
                                                      param: str) -> None:
    r = client.post(CHAT, json={"messages": [*MSGS, message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.added == []


def test_a_description_must_be_text(client: TestClient) -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": 5}}]
    r = _chat(client, tools=tools)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools[0].function.description"
