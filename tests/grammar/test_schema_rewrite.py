"""The exact schema rewrites (structspec/grammar/schema_rewrite.py): for every rule, the
rewritten schema accepts exactly the instances the original accepts, checked with
``jsonschema`` on generated instances and on every MaskBench instance; and the backends now
serve what they refused."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

from structspec.grammar.schema_rewrite import rewrite_schema, rewrite_schema_text
from tests.grammar.conftest import load_maskbench

_SCALARS: list[Any] = [None, True, False, 0, 1, -3, 2.5, "", "a", "foo", "this is a string",
                       "2024-01-01", "#ff00aa", "0", "a4"]
_KEYS = ("a", "b", "c", "bar", "foo", "type", "tags", "favoriteTopic")


def generated_instances() -> list[Any]:
    """Scalars, small arrays and objects over a few keys (every subset of four keys, with
    values of several types): ~250 instances."""
    out: list[Any] = list(_SCALARS)
    out += [[], [1], ["a", "a"], [1, "a", None], [[]], [{"foo": 12}], {"foo": 12}]
    values = [1, "x", True, None, {"bar": True}, ["section"]]
    for n in range(0, 5):
        for keys in itertools.combinations(_KEYS[:6], n):
            for v in values[: 3 if n > 2 else len(values)]:
                out.append({k: v for k in keys})
    out += [{"type": "section", "a": 1}, {"type": "os"}, {"foo": 1, "bar": 2}]
    return out


def validator_cls(schema: Any) -> type:
    """The draft a schema declares; draft-07 for one that uses ``dependencies`` without a
    ``$schema`` (2019-09+ validators ignore that keyword, the backends enforce it)."""
    default = (jsonschema.Draft7Validator if '"dependencies"' in json.dumps(schema)
               else jsonschema.Draft202012Validator)
    return jsonschema.validators.validator_for(schema, default=default)


def assert_same_validity(schema: Any, instances: list[Any]) -> list[str]:
    """Rewrite ``schema``; assert each instance is valid before iff valid after. Returns the
    rules applied."""
    out, done = rewrite_schema(schema)
    cls = validator_cls(schema)
    before, after = cls(schema), cls(out)
    for inst in instances:
        assert before.is_valid(inst) == after.is_valid(inst), (schema, out, inst)
    return [r.rule for r in done]


RULE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("format", {"type": "string", "format": "color-hex"}),
    ("format", {"type": "integer", "format": "int32"}),
    ("enum-filter", {"allOf": [{"enum": [1]}, {"not": {"type": "object"}}]}),
    ("enum-filter", {"allOf": [{"enum": [[]]},
                               {"not": {"not": {"enum": [6, "foo", [], True, {"foo": 12}]}}}]}),
    ("enum-filter", {"allOf": [{"enum": [[], [1], "a"]}, {"not": {"minItems": 1}}]}),
    ("enum-filter", {"enum": [1, "a", 2.5, None], "type": "string", "not": {"const": "b"}}),
    ("enum-filter", {"allOf": [{"enum": [{"bar": True}]}, {"not": {"properties": {
        "bar": {"$ref": "#/allOf/1/not/properties/foo"}, "foo": {"type": "integer"}}}}]}),
    ("lone-if", {"type": "object", "if": {"properties": {"a": {"type": "array",
                                                              "uniqueItems": True}}}}),
    ("lone-if", {"then": {"required": ["a"]}, "else": {"type": "string"}}),
    ("not-not", {"not": {"not": {"type": "string", "minLength": 2}}}),
    ("not-type", {"not": {"type": "object"}}),
    ("not-type", {"type": ["string", "object", "null"], "not": {"type": ["object", "null"]}}),
    ("not-type", {"not": {"type": ["number", "string"]}}),
    ("not-required", {"type": "object", "properties": {"a": {"type": "integer"}},
                      "not": {"required": ["a"]}}),
    ("not-required", {"not": {"required": ["foo"]}}),
    ("not-propertyNames", {"type": "object", "not": {"propertyNames": {"not": {
        "const": "foo"}}}, "patternProperties": {"o": {"type": "integer"}}}),
    ("not-propertyNames", {"not": {"propertyNames": {"not": {"enum": ["bar"]}}}}),
    ("oneOf-disjoint", {"oneOf": [{"type": "string"}, {"type": "array"}]}),
    ("oneOf-disjoint", {"oneOf": [{"const": 0}, {"const": 1}, {"const": 2}],
                        "type": "integer"}),
    ("oneOf-disjoint", {"oneOf": [{"type": "string", "minLength": 2}]}),
    ("oneOf-disjoint", {"oneOf": [{"enum": ["a", "foo"]}, {"type": "string", "maxLength": 0}]}),
    ("dependencies", {"type": "object", "properties": {"tags": {"type": "array"},
                                                        "favoriteTopic": {"type": "string"}},
                      "dependencies": {"favoriteTopic": ["tags"]}}),
    ("dependencies", {"type": "object", "required": ["a"],
                      "dependencies": {"a": ["b", "c"]}}),
    ("dependencies", {"type": "object", "dependencies": {
        "foo": {"properties": {"type": {"enum": ["section"]}}}, "bar": False, "c": True}}),
    ("dependentRequired", {"$schema": "https://json-schema.org/draft/2020-12/schema",
                           "dependentRequired": {"a": ["b"], "foo": []}}),
    ("dependentSchemas", {"$schema": "https://json-schema.org/draft/2020-12/schema",
                          "required": ["bar"],
                          "dependentSchemas": {"a": {"required": ["c"]},
                                               "bar": {"properties": {"foo": {"const": 1}}}}}),
]


@pytest.mark.parametrize("rule,schema", RULE_CASES,
                         ids=[f"{r}-{i}" for i, (r, _) in enumerate(RULE_CASES)])
def test_rule_is_exact_on_generated_instances(rule: str, schema: dict[str, Any]) -> None:
    rules = assert_same_validity(schema, generated_instances())
    assert rule in rules, rules


@pytest.mark.parametrize("schema", [
    # a $ref into the 'not' subtree from a part that is kept: removing it would dangle
    {"allOf": [{"enum": [1]}, {"not": {"$defs": {"s": {"type": "string"}}}}],
     "$defs": {"a": {"$ref": "#/allOf/1/not/$defs/s"}}},
    # oneOf branches that overlap (both accept "ab")
    {"oneOf": [{"type": "string"}, {"pattern": "a"}]},
    # not of integer: "numbers but not integers" has no type list
    {"not": {"type": "integer"}},
    # not of a required pair: an anyOf beside the node's keywords, not done
    {"not": {"required": ["a", "b"]}},
    # unevaluatedProperties depends on which subschemas evaluated what
    {"allOf": [{"enum": [{"a": 1}]}, {"properties": {"a": {}}}], "unevaluatedProperties": False},
    # a known format beside an enum: jsonschema would not check it, the backends do
    {"allOf": [{"enum": ["x"]}, {"format": "email"}]},
    # a whole if/then: it constrains (the backends refuse it, naming it)
    {"if": {"required": ["a"]}, "then": {"required": ["b"]}},
    # a lone 'if' that a $ref points into: removing it would dangle
    {"if": {"$defs": {"s": {"type": "string"}}}, "properties": {"a": {"$ref": "#/if/$defs/s"}}},
])
def test_unsafe_or_inexact_usages_are_left_alone(schema: dict[str, Any]) -> None:
    out, done = rewrite_schema(schema)
    assert out == schema and [r.rule for r in done if r.rule != "format"] == []


def test_maskbench_instances_keep_their_validity() -> None:
    """Every MaskBench schema that a rule rewrites: each of its instances (valid and invalid)
    and the generated ones have the same ``jsonschema`` validity before and after."""
    generated = generated_instances()
    rewritten = 0
    for _name, case in load_maskbench():
        out, done = rewrite_schema(case["schema"])
        if not done:
            continue
        rewritten += 1
        assert_same_validity(case["schema"], [t["data"] for t in case["tests"]] + generated)
    assert rewritten >= 50


def test_text_form_is_cached_and_keeps_unchanged_text() -> None:
    text = '{"type":"string"}'
    assert rewrite_schema_text(text) is text
    assert json.loads(rewrite_schema_text('{"type":"string","format":"color"}')) == {
        "type": "string"}
    assert rewrite_schema_text("not json") == "not json"


def test_llguidance_and_auto_serve_rewritten_schemas(hf_tokenizer: Any) -> None:
    """Schemas both backends refused before the rewrites now compile (on llguidance), and the
    rewritten grammar keeps refusing the invalid instances."""
    from structspec.config import GrammarConfig
    from structspec.constraints import JsonSchemaConstraint
    from structspec.grammar.llg_backend import LlgBackend
    from tests.grammar.conftest import STOP_ID

    llg = LlgBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[STOP_ID],
                     config=GrammarConfig(num_compile_threads=1))
    try:
        schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {
            "type": "string"}}, "favoriteTopic": {"type": "string", "format": "color"}},
            "dependencies": {"favoriteTopic": ["tags"]}, "not": {"required": ["x"]},
            "if": {"properties": {"tags": {"uniqueItems": True}}}}  # a lone if: no effect
        compiled = llg.compile(JsonSchemaConstraint(schema), timeout=30)
        for inst, ok in (({"tags": [], "favoriteTopic": "red"}, True), ({"tags": ["a"]}, True),
                         ({"tags": ["a", "a"]}, True),
                         ({"favoriteTopic": "red"}, False), ({}, True)):
            ids = hf_tokenizer.encode(json.dumps(inst, separators=(", ", ": ")),
                                      add_special_tokens=False) + [STOP_ID]
            m = llg.create_matcher(compiled)
            assert (m.accept_run(ids) == len(ids) and m.is_terminated()) is ok, inst
    finally:
        llg.shutdown()
