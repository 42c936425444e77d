"""Time-limited regex keywords in the host's JSON Schema checks
(structspec/grammar/bounded_validator.py): a client's backtracking pattern must not stall the
engine, and every verdict within the limit equals jsonschema's own."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar.bounded_validator import (
    PatternTimeLimit,
    bounded_search,
    bounded_validator,
)
from structspec.grammar.schema_check import find_unenforceable
from structspec.grammar.schema_rewrite import rewrite_schema_text
from structspec.scheduler.validate import check_schema_output

#: ``^(a|a)*$`` against ``a...ab`` backtracks 2**n ways: hours with Python's re at n = 40
SLOW_PATTERN = "^(a|a)*$"
SLOW_TEXT = "a" * 40 + "b"

CASES = [
    ({"type": "string", "pattern": "^[a-z]+$"}, ["abc", "aBc", "", 3]),
    ({"type": "string", "pattern": "b"}, ["abc", "xyz"]),  # search, not a full match
    ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
      "additionalProperties": False}, [{"x_a": 1}, {"x_a": "1"}, {"y": 1}, {}]),
    ({"type": "object", "properties": {"id": {"type": "string"}},
      "patternProperties": {"^n[0-9]$": {"type": "number"}, "^s": {"type": "string"}},
      "additionalProperties": {"type": "boolean"}},
     [{"id": "a", "n1": 2, "s": "t", "z": True}, {"n12": True}, {"n1": "x"}, {"z": 1}]),
    ({"type": "object", "additionalProperties": {"type": "string", "pattern": "^[0-9]{3}$"}},
     [{"a": "123"}, {"a": "12"}]),
    ({"type": "array", "items": {"type": "string", "pattern": "^(?:ab)+$"}},
     [["abab", "ab"], ["aba"]]),
]


@pytest.mark.parametrize("schema,instances", CASES)
def test_verdicts_equal_jsonschemas_own(schema: dict, instances: list) -> None:
    plain = jsonschema.Draft202012Validator(schema)
    bounded = bounded_validator(schema)
    assert bounded is not None
    for instance in instances:
        assert bounded.is_valid(instance) == plain.is_valid(instance), instance


def test_a_backtracking_pattern_stops_at_the_limit() -> None:
    t0 = time.perf_counter()
    with pytest.raises(PatternTimeLimit, match="took more than"):
        bounded_search(SLOW_PATTERN, SLOW_TEXT)
    validator = bounded_validator({"type": "object",
                                   "patternProperties": {SLOW_PATTERN: {"type": "integer"}}})
    with pytest.raises(PatternTimeLimit):
        validator.is_valid({SLOW_TEXT: 1})
    assert time.perf_counter() - t0 < 10.0  # hours without the limit; wide for a loaded CI machine


def test_unevaluated_properties_beside_pattern_properties_gets_no_validator() -> None:
    schema = {"allOf": [{"patternProperties": {"^a": {}}}], "unevaluatedProperties": False}
    assert bounded_validator(schema) is None
    assert check_schema_output(JsonSchemaConstraint(schema), '{"a": 1}') is None


def test_the_engines_checks_finish_on_a_backtracking_pattern() -> None:
    """The three host checks a request reaches (found by attacking the server: one request
    held the engine for 15 s, and longer strings would hold it for hours): the output's
    verdict, the exact rewrites and the strict check, each in well under a second."""
    t0 = time.perf_counter()
    # the grammar forces "a...ab"; `not` would be checked by backtracking: no verdict
    schema = {"type": "string", "pattern": "^a{40}b$", "not": {"pattern": SLOW_PATTERN}}
    assert check_schema_output(JsonSchemaConstraint(schema), json.dumps(SLOW_TEXT)) is None
    # a const that a backtracking pattern beside it must be checked against: the enum
    # filter cannot decide, so the schema is left as it is, and strict mode refuses it
    strict = {"type": "string", "const": SLOW_TEXT, "pattern": "^(?:(a|a)*c|a*b)$"}
    assert json.loads(str(rewrite_schema_text(json.dumps(strict)))) == strict
    problems = find_unenforceable(strict)
    assert any("too long to check the const" in why for _, why in problems), problems
    assert time.perf_counter() - t0 < 10.0  # hours without the limit
    # a fast pattern keeps its verdicts
    fast = {"type": "string", "pattern": "^a+b$"}
    assert check_schema_output(JsonSchemaConstraint(fast), json.dumps(SLOW_TEXT)) is True
    assert check_schema_output(JsonSchemaConstraint(fast), '"ba"') is False


def test_a_schema_of_many_slow_patterns_costs_one_budget() -> None:
    """60 properties, each a const beside a backtracking pattern: the strict check and the
    rewrite each stop at the document's budget (0.25 s), not at 60 x the per-search limit."""
    node = {"type": "string", "const": SLOW_TEXT, "pattern": "^(?:(a|a)*c|a*b)$"}
    schema = {"type": "object", "properties": {f"p{i}": dict(node) for i in range(60)}}
    t0 = time.perf_counter()
    problems = find_unenforceable(schema)
    assert len(problems) == 60  # every node reported, most without a search
    assert json.loads(str(rewrite_schema_text(json.dumps(schema)))) == schema
    assert time.perf_counter() - t0 < 2.5  # 60 x the 50 ms per-search limit would be 3 s


def test_a_ref_beside_const_is_reported_as_unchecked_not_violated() -> None:
    """A ``$ref`` among a const's siblings cannot be checked node by node: the strict check
    says so instead of claiming the value violates them (it matches ``a*b`` here)."""
    schema = {"$defs": {"s": {"type": "string", "pattern": "^(?:(a|a)*c|a*b)$"}},
              "$ref": "#/$defs/s", "const": SLOW_TEXT}
    reasons = [why for _, why in find_unenforceable(schema)]
    assert any("cannot be checked against them here" in why for why in reasons), reasons
    assert not any("violate" in why for why in reasons), reasons
