"""The shared grammar-value parser (:mod:`structspec.constraint_parse`): each value check in
the three callers' styles (CLI flag, ``--batch`` key, HTTP field), with the exact words each
caller used before the checks were shared."""

from __future__ import annotations

import json
from typing import Any

import pytest

from structspec import constraint_parse as cp
from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)

FLAG, BATCH, API = cp.FLAG_STYLE, cp.BATCH_STYLE, cp.API_STYLE


def refusal(check: Any, *args: Any, **kwargs: Any) -> cp.ConstraintFieldError:
    """The error ``check(*args, **kwargs)`` raises."""
    with pytest.raises(cp.ConstraintFieldError) as e:
        check(*args, **kwargs)
    return e.value


def test_a_refusal_is_a_value_error_naming_the_field() -> None:
    e = refusal(cp.regex_constraint, "", "guided_regex", API)
    assert isinstance(e, ValueError) and e.field == "guided_regex"


@pytest.mark.parametrize("style,name", [(FLAG, "--regex"), (BATCH, "regex"), (API, "regex")])
def test_regex_is_built(style: cp.FieldStyle, name: str) -> None:
    assert cp.regex_constraint("[0-9]+", name, style) == RegexConstraint("[0-9]+")


@pytest.mark.parametrize("style,name,value,message", [
    (FLAG, "--regex", "", "--regex: empty pattern"),
    (BATCH, "regex", "", "'regex' must be a non-empty string, got \"\""),
    (BATCH, "regex", None, "'regex' must be a non-empty string, got null"),
    (BATCH, "regex", 123, "'regex' must be a non-empty string, got 123"),
    (BATCH, "regex", " ", "'regex' must be a non-empty string, got \" \""),
    (API, "regex", "", "regex must be a non-empty string"),
    (API, "response_format.pattern", "", "response_format.pattern must be a non-empty string"),
])
def test_regex_refusals(style: cp.FieldStyle, name: str, value: Any, message: str) -> None:
    e = refusal(cp.regex_constraint, value, name, style)
    assert (str(e), e.field) == (message, name)


@pytest.mark.parametrize("style", [FLAG, API])
def test_a_blank_regex_is_a_pattern_for_the_flag_and_the_server(style: cp.FieldStyle) -> None:
    """Only the ``--batch`` reader counts a regex of spaces as empty (as it always did)."""
    assert cp.regex_constraint("  ", "regex", style) == RegexConstraint("  ")


@pytest.mark.parametrize("style,name,value,message", [
    (FLAG, "--ebnf", " \n", "--ebnf: empty grammar in 'g.gbnf'"),
    (BATCH, "ebnf", None, "'ebnf' must be a non-empty string, got null"),
    (BATCH, "ebnf", ['root ::= "x"'], "'ebnf' must be a non-empty string, got "
                                      '["root ::= \\"x\\""]'),
    (API, "guided_grammar", " ", "guided_grammar must be a non-empty grammar string"),
    (API, "grammar", 5, "grammar must be a non-empty grammar string"),
])
def test_ebnf_refusals(style: cp.FieldStyle, name: str, value: Any, message: str) -> None:
    e = refusal(cp.ebnf_constraint, value, name, style, source="g.gbnf")
    assert (str(e), e.field) == (message, name)


@pytest.mark.parametrize("style", [FLAG, BATCH, API])
def test_ebnf_is_built(style: cp.FieldStyle) -> None:
    assert cp.ebnf_constraint('root ::= "x"', "ebnf", style) == EbnfConstraint('root ::= "x"')


@pytest.mark.parametrize("style,name,value,message", [
    (FLAG, "--choice", [""], "--choice: empty choice (position 1)"),
    (FLAG, "--choice", ["yes", ""], "--choice: empty choice (position 2)"),
    (BATCH, "choice", "abc",
     "'choice' must be a non-empty list of non-empty strings, got \"abc\""),
    (BATCH, "choice", ["a", 1, None],
     "'choice' must be a non-empty list of non-empty strings, got [\"a\", 1, null]"),
    (BATCH, "choice", [], "'choice' must be a non-empty list of non-empty strings, got []"),
    (BATCH, "choice", {"x": 1},
     "'choice' must be a non-empty list of non-empty strings, got {\"x\": 1}"),
    (API, "guided_choice", [], "guided_choice must be a non-empty list of non-empty strings"),
    (API, "choice", ["a", ""], "choice must be a non-empty list of non-empty strings"),
])
def test_choice_refusals(style: cp.FieldStyle, name: str, value: Any, message: str) -> None:
    e = refusal(cp.choice_constraint, value, name, style)
    assert (str(e), e.field) == (message, name)


@pytest.mark.parametrize("style", [FLAG, BATCH, API])
def test_choice_is_built(style: cp.FieldStyle) -> None:
    assert cp.choice_constraint(["yes", "no"], "choice", style) == ChoiceConstraint(("yes", "no"))


@pytest.mark.parametrize("style,name,value,message", [
    (BATCH, "strict", "false", "'strict' must be true or false, got \"false\""),
    (BATCH, "json_object", 0, "'json_object' must be true or false, got 0"),
    (FLAG, "--strict", None, "--strict: expected true or false, got null"),
    (API, "structured_outputs.json_object", 1,
     "structured_outputs.json_object must be true or false"),
])
def test_boolean_refusals(style: cp.FieldStyle, name: str, value: Any, message: str) -> None:
    e = refusal(cp.boolean_field, value, name, style)
    assert (str(e), e.field) == (message, name)
    assert cp.boolean_field(False, name, style) is False


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_flag_schema_is_json_text() -> None:
    got = cp.json_schema_constraint(json.dumps(SCHEMA), "--json-schema", FLAG, strict=False)
    assert got == JsonSchemaConstraint(SCHEMA, strict=False)
    e = refusal(cp.json_schema_constraint, "{nope", "--json-schema", FLAG, strict=True)
    assert e.field == "--json-schema"
    assert str(e).startswith("--json-schema is neither a file nor valid JSON: Expecting")


@pytest.mark.parametrize("style,name", [(FLAG, "--json-schema"),
                                        (cp.API_STYLE, "response_format.json_schema.schema")])
def test_schema_text_of_a_json_string_is_refused_as_a_string(style: cp.FieldStyle,
                                                             name: str) -> None:
    """'"abc"' is JSON (a string), not a schema: refused naming the field and saying so, not
    reported as text that is not JSON."""
    e = refusal(cp.json_schema_constraint, '"abc"', name, style, strict=True)
    assert e.field == name
    assert str(e) == f"{name}: a JSON string is not a JSON Schema (an object, or true / false)"


def test_flag_schema_of_another_json_type_is_left_to_the_engine() -> None:
    """``--json-schema 5`` was never checked here: its request fails when the engine reads
    the schema (kept as it was)."""
    got = cp.json_schema_constraint("5", "--json-schema", FLAG, strict=True)
    with pytest.raises(ValueError, match="json_schema must be a JSON object, got number"):
        got.canonical_text()


@pytest.mark.parametrize("style", [FLAG, BATCH])
@pytest.mark.parametrize("value,text", [(True, "true"), (False, "false")])
def test_boolean_schema_is_kept_as_json_text(style: cp.FieldStyle, value: bool,
                                             text: str) -> None:
    """The flag reads ``true`` as JSON; a batch line has the boolean itself."""
    given: Any = text if style is FLAG else value
    got = cp.json_schema_constraint(given, "json_schema", style, strict=True)
    assert got.canonical_text() == text and got.strict is True


@pytest.mark.parametrize("value,json_type", [(5, "number"), ([SCHEMA], "array"),
                                             ("{}", "string"), (None, "null")])
def test_batch_schema_must_be_an_object_or_boolean(value: Any, json_type: str) -> None:
    """A batch line's schema is a JSON value, never JSON text inside a string."""
    e = refusal(cp.json_schema_constraint, value, "json_schema", BATCH, strict=True)
    assert e.field == "json_schema"
    assert str(e) == ("'json_schema' must be a JSON Schema object (or true/false), got "
                      f"{json_type}")
    got = cp.json_schema_constraint(SCHEMA, "json_schema", BATCH, strict=False)
    assert got == JsonSchemaConstraint(SCHEMA, strict=False)


def test_api_schema_text_objects_and_booleans() -> None:
    assert cp.json_schema_constraint('{"type": "object"}', "json_schema", API,
                                     strict=False) == JsonSchemaConstraint({"type": "object"},
                                                                           strict=False)
    assert cp.json_schema_constraint(True, "guided_json", API, strict=True) == \
        JsonSchemaConstraint({}, strict=True)
    assert cp.json_schema_constraint(False, "guided_json", API, strict=True) == \
        JsonSchemaConstraint({"not": {}}, strict=True)
    e = refusal(cp.json_schema_constraint, "[1, 2]", "json_schema", API, strict=False)
    assert (str(e), e.field) == ("json_schema must be a JSON Schema object, got array",
                                 "json_schema")
    e = refusal(cp.json_schema_constraint, "{nope", "json_schema", API, strict=False)
    assert str(e).startswith("json_schema (a string) is not valid JSON: Expecting")


def test_api_schema_text_goes_through_the_given_reader() -> None:
    """The server passes its own JSON reader (it locates an over-long integer); its errors
    pass through unchanged."""
    read: list[str] = []

    class ReaderError(Exception):
        pass

    def loads(text: str) -> Any:
        read.append(text)
        if text == "bad":
            raise ReaderError(text)
        return json.loads(text)

    got = cp.json_schema_constraint('{"type": "string"}', "guided_json", API, strict=False,
                                    loads=loads)
    assert got == JsonSchemaConstraint({"type": "string"}, strict=False)
    with pytest.raises(ReaderError):
        cp.json_schema_constraint("bad", "guided_json", API, strict=False, loads=loads)
    assert read == ['{"type": "string"}', "bad"]


def test_api_schema_structure_is_checked_before_it_is_served() -> None:
    remote = {"$ref": "https://example.com/s.json"}
    e = refusal(cp.json_schema_constraint, remote, "response_format.json_schema.schema", API,
                strict=True)
    assert e.field == "response_format.json_schema.schema"
    assert str(e).startswith("response_format.json_schema.schema cannot be served: /$ref:")
    deep: Any = {}
    for _ in range(300):  # far past MAX_SCHEMA_NESTING: refused, and the refusal is cheap
        deep = {"items": deep}
    e = refusal(cp.json_schema_constraint, deep, "json_schema", API, strict=True)
    assert "nests deeper than" in str(e)
    # the other callers leave it to the engine
    assert cp.json_schema_constraint(remote, "json_schema", BATCH, strict=True).schema == remote


def test_shown_json_is_cut() -> None:
    assert cp.shown_json("x" * 200).endswith("...") and len(cp.shown_json("x" * 200)) == 83
    assert cp.shown_json([True, None]) == "[true, null]"
    assert [cp.json_type_name(v) for v in (None, True, 1, 1.5, "", [], {})] == [
        "null", "boolean", "number", "number", "string", "array", "object"]
