"""The JSON number loop guard (issue 20): default bounds on unbounded integers and numbers,
never a weaker grammar, and xgrammar's any-value number rules bounded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from structspec.constraints import JsonObjectConstraint, JsonSchemaConstraint
from structspec.grammar.number_bounds import INTEGER_BOUND, NUMBER_BOUND, bound_schema_numbers
from structspec.grammar.xgr_numbers import ANY_NUMBER_RULES, bounded_json_schema_grammar
from tests.grammar.conftest import load_maskbench

INT, NUM = INTEGER_BOUND, NUMBER_BOUND
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"], "additionalProperties": False}


@pytest.mark.parametrize(("schema", "want"), [
    ({"type": "integer"}, {"type": "integer", "minimum": -INT, "maximum": INT}),
    ({"type": ["number", "null"]}, {"type": ["number", "null"], "minimum": -NUM, "maximum": NUM}),
    ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": INT}),
    ({"type": "number", "exclusiveMaximum": 1.5},
     {"type": "number", "exclusiveMaximum": 1.5, "minimum": -NUM}),
    # a bound of its own outside the default range: the other side stays open
    ({"type": "integer", "minimum": 10**20}, {"type": "integer", "minimum": 10**20}),
    ({"type": "integer", "exclusiveMaximum": -INT}, {"type": "integer", "exclusiveMaximum": -INT}),
    # finite already, or a keyword a range would drop / a $ref beside it: untouched
    ({"type": "integer", "enum": [10**30]}, {"type": "integer", "enum": [10**30]}),
    ({"type": "integer", "multipleOf": 5}, {"type": "integer", "multipleOf": 5}),
    # negative places (and what a $ref from there reaches) are never narrowed
    ({"not": {"type": "integer"}}, {"not": {"type": "integer"}}),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]},
     {"oneOf": [{"type": "integer"}, {"type": "string"}]}),
    ({"properties": {"a": {"$ref": "#/$defs/x"}, "b": {"not": {"$ref": "#/$defs/x"}}},
      "$defs": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
     {"properties": {"a": {"$ref": "#/$defs/x"}, "b": {"not": {"$ref": "#/$defs/x"}}},
      "$defs": {"x": {"type": "integer"},
                "y": {"type": "integer", "minimum": -INT, "maximum": INT}}}),
    ({"type": "integer", "if": {"$ref": "#"}}, {"type": "integer", "if": {"$ref": "#"}}),
    ({"type": "integer", "not": {"$ref": "other.json"}},
     {"type": "integer", "not": {"$ref": "other.json"}}),
    # positive places: properties, items (both forms), anyOf, allOf, then, $defs
    ({"items": [{"type": "integer"}], "anyOf": [{"items": {"type": "number"}}],
      "then": {"type": "integer"}},
     {"items": [{"type": "integer", "minimum": -INT, "maximum": INT}],
      "anyOf": [{"items": {"type": "number", "minimum": -NUM, "maximum": NUM}}],
      "then": {"type": "integer", "minimum": -INT, "maximum": INT}}),
])
def test_schema_rewrite(schema: dict[str, Any], want: dict[str, Any]) -> None:
    before = json.dumps(schema)
    assert bound_schema_numbers(schema) == want
    assert json.dumps(schema) == before  # the caller's schema is not modified


def _matcher(grammar: xgr.Grammar) -> Any:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        grammar)


def _accepts(compiled: Any, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return bool(m.accept_string(text)) and bool(m.is_completed())


def test_bounded_grammar_accepts_exactly_the_schemas_instances_within_bounds() -> None:
    """On MaskBench (a third of the cases, with their valid and invalid instances): the
    bounded grammar never accepts what the original refuses, and accepts every instance the
    original accepts (none of them has a number past the bounds)."""
    checked = 0
    for name, case in load_maskbench()[::3]:
        text = json.dumps(case["schema"])
        try:
            original = _matcher(xgr.Grammar.from_json_schema(text, any_whitespace=False,
                                                             strict_mode=True))
        except Exception:  # noqa: BLE001 - a schema xgrammar refuses is not this test's
            continue
        bounded = _matcher(bounded_json_schema_grammar(
            json.dumps(bound_schema_numbers(case["schema"])), any_whitespace=False))
        for t in case.get("tests", []):
            data = json.dumps(t["data"], separators=(", ", ": "), ensure_ascii=False)
            assert _accepts(bounded, data) == _accepts(original, data), (name, data[:200])
            checked += 1
    assert checked > 200


def test_any_value_numbers_are_bounded() -> None:
    grammar = bounded_json_schema_grammar('{"type": "object"}', any_whitespace=False)
    assert not any(rule in str(grammar).split("\n") for rule in ANY_NUMBER_RULES)
    compiled = _matcher(grammar)
    for text, ok in [('{"a": [1, {"b": -0.5}, 1e10]}', True),
                     ('{"a": 1234567890123456}', True), ('{"a": 12345678901234567}', False),
                     ('{"a": 1.123456}', True), ('{"a": 1.1234567}', False),
                     ('{"a": 1e99}', True), ('{"a": 1e100}', False)]:
        assert _accepts(compiled, text) is ok, text


def _population_digits(matcher: Any, hf_tokenizer: Any, digits: int) -> bool:
    text = '{"name": "Lisbon", "country": "Portugal", "population": ' + "1" + "0" * (digits - 1)
    return matcher.accept_run(hf_tokenizer.encode(text, add_special_tokens=False)) == len(
        hf_tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("which", ["xgrammar", "llguidance"])
def test_city_population_is_bounded_unless_lifted(which: str, request: pytest.FixtureRequest,
                                                  hf_tokenizer: Any) -> None:
    """The issue's example: an integer property stops at 19 digits (10**18) by default, on
    both backends, and runs on with ``bounded_numbers=False``."""
    backend = request.getfixturevalue("backend" if which == "xgrammar" else "llg_backend")

    def matcher(bounded: bool) -> Any:
        spec = JsonSchemaConstraint(CITY, bounded_numbers=bounded)
        return backend.create_matcher(backend.compile(spec, timeout=120))

    assert _population_digits(matcher(True), hf_tokenizer, 19)
    assert not _population_digits(matcher(True), hf_tokenizer, 20)
    assert _population_digits(matcher(False), hf_tokenizer, 40)


def test_bounded_and_unbounded_are_separate_cache_entries(backend: Any) -> None:
    a = backend.compile(JsonObjectConstraint(), timeout=120)
    b = backend.compile(JsonObjectConstraint(bounded_numbers=False), timeout=120)
    assert a is not b
    with pytest.raises(TypeError, match="bounded_numbers"):
        JsonSchemaConstraint(CITY, bounded_numbers="no")  # type: ignore[arg-type]
