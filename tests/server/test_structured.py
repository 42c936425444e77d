"""Request fields -> grammar spec and sampling params (no server, no model)."""

from __future__ import annotations

from typing import Any

import pytest

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from structspec.server.errors import APIError
from structspec.server.params import DEFAULT_MAX_TOKENS, build_sampling_params, per_choice
from structspec.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from structspec.server.structured import grammar_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSGS = [{"role": "user", "content": "hi"}]


def grammar(**body: Any) -> Any:
    return grammar_from_request(parse_request(ChatCompletionRequest, {"messages": MSGS, **body}))


@pytest.mark.parametrize("body,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, JsonObjectConstraint()),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     JsonSchemaConstraint(SCHEMA, strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     JsonSchemaConstraint(SCHEMA, strict=False)),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, JsonSchemaConstraint(SCHEMA, False)),
    ({"response_format": {"type": "json", "schema": SCHEMA}}, JsonSchemaConstraint(SCHEMA, False)),
    ({"response_format": {"type": "regex", "regex": "a+"}}, RegexConstraint("a+")),
    ({"response_format": {"type": "regex", "pattern": "b+"}}, RegexConstraint("b+")),
    ({"response_format": {"type": "ebnf", "ebnf": 'root ::= "x"'}}, EbnfConstraint('root ::= "x"')),
    ({"response_format": {"type": "ebnf", "grammar": 'root ::= "y"'}}, EbnfConstraint('root ::= "y"')),
    ({"response_format": {"type": "choice", "choices": ["a", "b"]}}, ChoiceConstraint(("a", "b"))),
    ({"regex": "[0-9]+"}, RegexConstraint("[0-9]+")),
    ({"ebnf": 'root ::= "z"'}, EbnfConstraint('root ::= "z"')),
    ({"grammar": 'root ::= "z"'}, EbnfConstraint('root ::= "z"')),
    ({"json_schema": SCHEMA}, JsonSchemaConstraint(SCHEMA, strict=False)),
    ({"json_schema": '{"type": "object"}'}, JsonSchemaConstraint({"type": "object"}, strict=False)),
    ({"choice": ["yes", "no"]}, ChoiceConstraint(("yes", "no"))),
    ({"guided_json": SCHEMA}, JsonSchemaConstraint(SCHEMA, strict=False)),
    ({"guided_regex": "x"}, RegexConstraint("x")),
    ({"guided_choice": ["p", "q"]}, ChoiceConstraint(("p", "q"))),
    ({"guided_grammar": 'root ::= "g"'}, EbnfConstraint('root ::= "g"')),
    ({"structured_outputs": {"json": SCHEMA}}, JsonSchemaConstraint(SCHEMA, strict=False)),
    ({"structured_outputs": {"regex": "r"}}, RegexConstraint("r")),
    ({"structured_outputs": {"choice": ["c"]}}, ChoiceConstraint(("c",))),
    ({"structured_outputs": {"grammar": 'root ::= "s"'}}, EbnfConstraint('root ::= "s"')),
    ({"structured_outputs": {"json_object": True}}, JsonObjectConstraint()),
])
def test_every_shape_maps_to_one_grammar(body: dict[str, Any], expected: Any) -> None:
    assert grammar(**body) == expected


@pytest.mark.parametrize("body,param", [
    ({"regex": "a", "choice": ["b"]}, "choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "regex"}}, "response_format.regex"),
    ({"response_format": {"type": "regex", "pattern": ""}}, "response_format.pattern"),
    ({"response_format": {"type": "gbnf", "grammar": " "}}, "response_format.grammar"),
    ({"response_format": {"type": "choice", "choice": []}}, "response_format.choice"),
    ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"regex": ""}, "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        grammar(**body)
    assert e.value.status == 400
    assert e.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),  # no silent coercion of strings, floats or bools
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"n": True}, "n"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_logprobs": 2.5}, "top_logprobs"),
    ({"stop_token_ids": [2.5]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"seed": "1"}, "seed"),
    ({"stop": 3}, "stop"),
    ({"response_format": "json"}, "response_format"),
    # numbers: JSON numbers only (no numeric strings, no booleans)
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": False}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"presence_penalty": "0"}, "presence_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"repetition_penalty": "1"}, "repetition_penalty"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    # booleans: JSON true/false only (no "yes", "true", 1 or 0)
    ({"stream": "yes"}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "true"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json", "strict": 1}}, "response_format.strict"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ({"json_schema": 1}, "json_schema"),  # not the boolean schema true
])
def test_wrong_types_are_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {"messages": MSGS, **body})
    assert e.value.status == 400
    assert e.value.param == param, e.value.message


@pytest.mark.parametrize("value,message", [
    ("0.5", "Input should be a valid number"),
    (True, "Input should be a valid number"),
    (10**400, "Input should be a finite number"),
])
def test_wrong_number_message(value: Any, message: str) -> None:
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {"messages": MSGS, "temperature": value})
    assert e.value.status == 400 and e.value.param == "temperature"
    assert e.value.message == f"invalid value for 'temperature': {message}"


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [0, 1, 0.5])
def test_number_fields_take_json_ints_and_floats(field: str, value: float) -> None:
    """A JSON ``1`` is a number too (pydantic's StrictFloat has not always taken ints)."""
    req = parse_request(ChatCompletionRequest, {"messages": MSGS, field: value})
    got = getattr(req, field)
    assert got == value and isinstance(got, float)
    req = parse_request(CompletionRequest, {"prompt": "x", field: value})
    assert getattr(req, field) == value


@pytest.mark.parametrize("field", ["stream", "ignore_eos", "logprobs"])
def test_bool_fields_take_json_booleans(field: str) -> None:
    for value in (True, False):
        req = parse_request(ChatCompletionRequest, {"messages": MSGS, field: value})
        assert getattr(req, field) is value


def test_unknown_fields_are_ignored() -> None:
    req = parse_request(ChatCompletionRequest, {"messages": MSGS, "frobnicate": {"x": 1}})
    assert req.messages[0]["content"] == "hi"


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 2.5}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"best_of": 2.0}, "best_of"),
    ({"best_of": True}, "best_of"),
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"stream": "yes"}, "stream"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"prompt": [True, 2]}, "prompt"),  # token ids are JSON integers, as the other int fields
    ({"prompt": [[1], [2.0]]}, "prompt"),
])
def test_completion_wrong_types_are_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"prompt": "x", **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_completion_prompt_shapes() -> None:
    for p in ("text", [1, 2, 3], ["a", "b"], [[1], [2, 3]]):
        assert parse_request(CompletionRequest, {"prompt": p}).prompt == p


def params(**body: Any) -> Any:
    req = parse_request(ChatCompletionRequest, {"messages": MSGS, **body})
    return build_sampling_params(req, grammar=None, max_tokens=req.max_tokens,
                                 logprobs=None, prompt_len=10, max_model_len=100)


def test_sampling_params_defaults_and_mapping() -> None:
    p = params()
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.max_tokens == min(DEFAULT_MAX_TOKENS, 90)
    assert params(max_tokens=90).max_tokens == 90  # prompt + max_tokens == max_model_len fits
    p = params(temperature=0, top_k=-1, min_p=0.1, seed=7, stop="END", max_tokens=5)
    assert (p.temperature, p.top_k, p.min_p, p.seed, p.stop, p.max_tokens) == (
        0.0, 0, 0.1, 7, ("END",), 5)
    assert [q.seed for q in per_choice(p, 3)] == [7, 8, 9]
    assert [q.seed for q in per_choice(params(), 2)] == [None, None]


@pytest.mark.parametrize("body,param", [
    ({"top_p": 0}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 91}, "max_tokens"),  # 10 prompt + 91 > max_model_len 100
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": ["", "x"]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # served since issue 20; in [-2, 2]
    ({"logit_bias": {"1": 200}}, "logit_bias"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**70}, "seed"),
])
def test_bad_sampling_values_are_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        params(**body)
    assert e.value.status == 400 and e.value.param == param
