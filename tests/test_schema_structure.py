"""find_structure_problem: what the engine refuses in every mode (remote or dangling $ref,
nesting too deep), and check_schema_output never fetching a $ref nor raising."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from structspec.constraints import JsonSchemaConstraint
from structspec.scheduler.validate import check_schema_output
from structspec.schema_structure import MAX_SCHEMA_NESTING, find_structure_problem


def _nested(levels: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    cur = root
    for _ in range(levels):
        cur["properties"] = {"a": {}}
        cur = cur["properties"]["a"]
    return root


@pytest.mark.parametrize("schema, expected", [
    ({"$ref": "urn:foo"}, "/$ref: $ref 'urn:foo' is not a local reference"),
    ({"items": [{"type": "string"}, {"$ref": "https://example.com/s.json#/a"}]},
     "/items/1/$ref: $ref 'https://example.com/s.json#/a' is not a local reference"),
    ({"properties": {"a/b": {"$dynamicRef": "other.json"}}},
     "/properties/a~1b/$dynamicRef: $dynamicRef 'other.json' is not a local reference"),
    ({"$ref": "#/$defs/missing", "$defs": {}}, "/$ref: $ref '#/$defs/missing' points to nothing"),
    (_nested(MAX_SCHEMA_NESTING), "the schema nests deeper than 128 levels"),
    ({"default": _nested(MAX_SCHEMA_NESTING)}, "/default: the schema nests deeper"),
    # regexes refused as the regex field refuses them (an unknown escape, an empty class)
    ({"type": "string", "pattern": "\\q"}, "/pattern: unknown escape '\\q' at position 0"),
    ({"properties": {"a": {"type": "string", "pattern": "x[^]"}}},
     "/properties/a/pattern: empty character class '[^]'"),
    ({"type": "object", "patternProperties": {"^a\\z": {}}},
     "/patternProperties/^a\\z: unknown escape"),
])
def test_refused_structure_names_the_pointer(schema: Any, expected: str) -> None:
    problem = find_structure_problem(schema)
    assert problem is not None and expected in problem, problem


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [
        {"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"},
    {"$ref": "#"},
    {"$ref": "#node", "$anchor": "node"},  # anchors are not resolved here
    {"const": {"$ref": "http://not.a.reference/"}},  # instance data, not a subschema
    {"properties": {"$ref": {"type": "string"}}},  # a property named "$ref"
    {"properties": {"pattern": {"type": "string", "pattern": "^[a-z]\\d+\\.$"}}},
    {"enum": [{"pattern": "\\q"}]},  # instance data, not a regex
    _nested(MAX_SCHEMA_NESTING // 2 - 1),
    True,
])
def test_servable_schemas_pass(schema: Any) -> None:
    assert find_structure_problem(schema) is None


def test_output_check_never_fetches_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonschema's default registry would GET a remote $ref (from the engine's step, with no
    timeout); the check has none to use and gives no verdict instead of raising."""
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    spec = JsonSchemaConstraint({"type": "object",
                           "properties": {"a": {"$ref": "http://127.0.0.1:9/s.json"}}})
    assert check_schema_output(spec, '{"a": 1}') is None
    assert check_schema_output(JsonSchemaConstraint({"$ref": "urn:foo"}), "1") is None
    # a usable schema still gives a verdict
    ok = JsonSchemaConstraint({"type": "object", "required": ["a"]})
    assert check_schema_output(ok, '{"a": 1}') is True
    assert check_schema_output(ok, "{}") is False


def test_a_property_named_like_a_data_keyword_is_checked_as_a_schema() -> None:
    """``properties.enum`` is a property's schema, not instance data: its ``$ref`` and
    ``pattern`` are checked as anywhere else (they were skipped as data)."""
    remote = {"type": "object", "properties": {"const": {"$ref": "https://example.com/s"}}}
    problem = find_structure_problem(remote)
    assert problem is not None and problem.startswith("/properties/const/$ref:")
    pattern = {"type": "object", "properties": {"enum": {"type": "string", "pattern": "^\\q$"}}}
    problem = find_structure_problem(pattern)
    assert problem is not None and problem.startswith("/properties/enum/pattern")
    dangling = {"$defs": {"default": {"$ref": "#/$defs/missing"}}}
    assert find_structure_problem(dangling) is not None
    data = {"const": {"$ref": "https://example.com/s"}, "enum": [{"pattern": "\\q"}]}
    assert find_structure_problem(data) is None  # instance data stays data
