"""The exact schema rewrites (structspec/grammar/schema_rewrite.py): for every rule, the
rewritten schema accepts exactly the instances the original accepts, checked with
``jsonschema`` on generated instances and on every MaskBench instance; and the backends now
serve what they refused."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import llguidance
import pytest

from structspec.grammar.llg_compile import json_options
from structspec.grammar.schema_check import find_unenforceable
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
    # oneOf: a name one branch requires, the other forbids (closed, or 'name': false); only
    # objects are told apart, the node's type excludes the rest
    ("oneOf-disjoint", {"type": "object", "oneOf": [
        {"required": ["a"], "properties": {"a": {}}},
        {"properties": {"b": {}}, "additionalProperties": False}]}),
    ("oneOf-disjoint", {"oneOf": [{"type": "object", "required": ["foo"]},
                                  {"type": "object", "properties": {"foo": False}},
                                  {"type": "string"}]}),
    # a property both require, told apart by literal patterns (a finite set of strings)
    ("oneOf-disjoint", {"type": "object", "oneOf": [
        {"required": ["type"], "properties": {"type": {"type": "string", "pattern": "^os$"}}},
        {"required": ["type"], "properties": {"type": {"type": "string",
                                                       "pattern": "^section$"}}}]}),
    # closed one-property branches, two accepting {} (which oneOf rejects)
    ("oneOf-disjoint", {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
        {"type": "object", "properties": {"c": {}}, "required": ["c"],
         "additionalProperties": False}]}),
    ("oneOf-required", {"type": "object", "properties": {"a": {"type": "integer"}},
                        "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]},
                                  {"required": ["foo", "c"]}]}),
    # no type: a non-object matches every branch, so oneOf rejects it
    ("oneOf-required", {"oneOf": [{"required": ["a"]}, {"required": ["b"]},
                                  {"required": ["a", "b", "c"]}]}),
    ("allOf-merge", {"type": ["object", "string"], "allOf": [
        {"$ref": "#/$defs/base"},
        {"properties": {"a": {}, "b": {"type": "integer"}, "foo": {}},
         "additionalProperties": False}],
        "$defs": {"base": {"type": "object", "required": ["a"],
                           "properties": {"a": {"type": "integer"}, "c": {}}}}}),
    ("allOf-merge", {"allOf": [{"properties": {"foo": {"type": "integer"}}},
                               {"properties": {"foo": {"minimum": 2}}, "required": ["bar"]},
                               {"allOf": [{"maxProperties": 2}, {"description": "x"}]}]}),
    ("allOf-merge", {"$schema": "http://json-schema.org/draft-04/schema#",
                     "definitions": {"n": {"type": "integer", "minimum": 0}},
                     "allOf": [{"$ref": "#/definitions/n"}, {"default": 0}]}),
    ("allOf-merge", {"allOf": [{"type": "string"}, {"maxLength": 3}, {"pattern": "o"}]}),
]


@pytest.mark.parametrize("rule,schema", RULE_CASES,
                         ids=[f"{r}-{i}" for i, (r, _) in enumerate(RULE_CASES)])
def test_rule_is_exact_on_generated_instances(rule: str, schema: dict[str, Any]) -> None:
    rules = assert_same_validity(schema, generated_instances())
    assert rule in rules, rules


@pytest.mark.parametrize("schema", [
    # a $ref into the 'not' subtree from a part that is kept: removing it would dangle
    {"enum": [1], "not": {"$defs": {"s": {"type": "string"}}},
     "$defs": {"a": {"$ref": "#/not/$defs/s"}}},
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
    # a discriminator property tells objects apart, but 5 matches both branches
    {"oneOf": [{"properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"properties": {"k": {"const": "b"}}, "required": ["k"]}]},
    # 'a' required by one, forbidden by the other: but both accept "x"
    {"type": ["object", "string"], "oneOf": [{"required": ["a"]},
                                             {"properties": {"a": False}}]},
    # additionalProperties: false beside patternProperties forbids only the names no
    # pattern matches (here "a" is allowed)
    {"type": "object", "oneOf": [{"required": ["a"]}, {"additionalProperties": False,
                                                       "patternProperties": {"^a": {}}}]},
    # not literal patterns ("os" matches both)
    {"type": "object", "oneOf": [
        {"required": ["t"], "properties": {"t": {"type": "string", "pattern": "^o.$"}}},
        {"required": ["t"], "properties": {"t": {"type": "string", "pattern": "^os$"}}}]},
    # "os\n" matches both: Python's $ (jsonschema's) matches before a final newline
    {"oneOf": [{"type": "string", "pattern": "^os$"}, {"type": "string", "pattern": "^os\n$"}]},
    # a branch accepting {} that is not closed to one property: {} is not all they share
    {"oneOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
               {"type": "object", "properties": {"b": {}}}]},
    # oneOf of required lists, one with another keyword
    {"oneOf": [{"required": ["a"]}, {"required": ["b"], "properties": {"a": False}}]},
    # the same list twice: every object matches both or neither
    {"oneOf": [{"required": ["a", "b"]}, {"required": ["b", "a"]}]},
    # allOf: an additionalProperties schema, patternProperties, the same keyword twice
    {"allOf": [{"properties": {"a": {}}}, {"additionalProperties": {"type": "integer"}}]},
    {"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
               {"patternProperties": {"^b": {}}}]},
    {"allOf": [{"pattern": "a"}, {"pattern": "b"}]},
    # draft-07 ignores an allOf beside $ref; 2019-09 and later do not (for the merge, and for
    # the enum filter, whose values would replace the $ref)
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x": {}},
     "$ref": "#/definitions/x", "allOf": [{"type": "string"}, {"maxLength": 2}]},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x": {}},
     "$ref": "#/definitions/x", "allOf": [{"enum": [1, "a"]}, {"type": "string"}]},
    # a format beside enum values: jsonschema would not check them (the strict check does so)
    {"allOf": [{"enum": ["x"]}, {"format": "email"}, {"type": "string"}]},
    # an $id below the root: a copied $ref might resolve from another base
    {"allOf": [{"$ref": "#/$defs/x"}, {"required": ["a"]}],
     "$defs": {"x": {"$id": "https://example.com/x", "type": "object"}}},
    # a closed part without a required name: no object is valid, left to the backends
    {"allOf": [{"required": ["b"]}, {"properties": {"a": {}}, "additionalProperties": False}]},
])
def test_unsafe_or_inexact_usages_are_left_alone(schema: dict[str, Any]) -> None:
    out, done = rewrite_schema(schema)
    assert out == schema and [r.rule for r in done if r.rule != "format"] == []
    assert_same_validity(schema, generated_instances())  # (trivially: nothing changed)


def test_refs_into_list_items_are_copied_out_before_the_other_rules() -> None:
    """A ``$ref`` into an ``allOf`` branch (an array index, which xgrammar does not follow)
    points at a copy first (``ref-pointer``); the merge, which would change what the old
    pointer names, then applies, exactly."""
    schema = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}],
              "properties": {"b": {"$ref": "#/allOf/0/properties/a"}}}
    rules = assert_same_validity(schema, generated_instances() + [{"a": 1, "b": "x"},
                                                                 {"a": 1, "b": 2}])
    assert rules == ["ref-pointer", "allOf-merge"]
    assert find_unenforceable(rewrite_schema(schema)[0]) == []


# instances for the rules that look inside properties and at {}, beside the generated ones
_NESTED = [{}, {"type": "os"}, {"type": "os\n"}, {"type": "section"}, {"type": "sections"},
           {"to": {}}, {"to": {"reachable": True}}, {"to": {"path": "x"}},
           {"to": {"reachable": True, "path": "x"}}, {"from": {}, "to": {"reachable": False}},
           {"a": 1, "b": 2}, {"a": "x"}, {"b": {}}, {"c": None}, {"a": 1, "c": 2}, {"d": 1}]


@pytest.mark.parametrize("schema,rule", [
    ({"type": "object", "oneOf": [
        {"required": ["to"], "properties": {"to": {"$ref": "#/$defs/plain"}}},
        {"required": ["to"], "properties": {"to": {"$ref": "#/$defs/reach"}}}],
      "$defs": {"plain": {"type": "object", "properties": {"path": {}},
                          "additionalProperties": False},
                "reach": {"required": ["reachable"], "properties": {"path": {},
                          "reachable": {"type": "boolean"}}, "additionalProperties": False}}},
     "oneOf-disjoint"),
    ({"type": "object", "minProperties": 1, "properties": {"a": {"type": "integer"}, "b": {}},
      "propertyNames": {"maxLength": 1}, "uniqueItems": True}, "minProperties"),
    ({"type": "object", "minProperties": 1, "properties": {"a": {}, "b": {}},
      "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"maxProperties": 1}],
      "not": {"required": ["x", "y"]}}, "minProperties"),
    ({"minProperties": 1, "properties": {"a": {}}, "required": ["b"], "contains": {}},
     "minProperties"),
])
def test_nested_and_empty_object_cases_are_exact(schema: dict[str, Any], rule: str) -> None:
    rules = assert_same_validity(schema, generated_instances() + _NESTED)
    assert rule in rules, rules


def test_min_properties_split_only_when_xgrammar_refuses_anyway() -> None:
    """xgrammar enforces ``minProperties`` beside optional properties itself: the split,
    which it does not take, is left for schemas its strict check refuses anyway."""
    served = {"type": "object", "minProperties": 1, "properties": {"a": {}, "b": {}}}
    assert rewrite_schema(served) == (served, [])
    refused = {**served, "properties": {"a": {}, "b": {"type": "array", "uniqueItems": True}}}
    out, done = rewrite_schema(refused)
    assert [r.rule for r in done] == ["minProperties"] and "minProperties" not in out


def test_one_of_required_is_exclusive() -> None:
    """Each branch of the rewrite admits objects with exactly one of the lists complete."""
    schema = {"type": "object", "oneOf": [{"required": ["radius"]},
                                          {"required": ["length", "width"]},
                                          {"required": ["base", "height"]}]}
    names = ["base", "height", "length", "radius", "width"]
    instances = [{n: 1 for n in keys} for k in range(len(names) + 1)
                 for keys in itertools.combinations(names, k)]
    assert assert_same_validity(schema, instances) == ["oneOf-required"]
    out, _ = rewrite_schema(schema)
    # radius: one of length/width and one of base/height absent (4); each pair: radius and one of
    # the other pair absent (2 each)
    assert "oneOf" not in out and len(out["anyOf"]) == 8


def test_merged_all_of_is_flat_for_xgrammar() -> None:
    """The merge of object-shaped parts passes xgrammar's strict check (multi-branch
    ``allOf`` and keywords beside it are what it refuses)."""
    schema = {"type": "object", "allOf": [
        {"$ref": "#/definitions/both"},
        {"properties": {"x": {}, "y": {"$ref": "#/definitions/y"}}, "additionalProperties": False}],
        "definitions": {"both": {"allOf": [{"$ref": "#/definitions/x"},
                                           {"$ref": "#/definitions/z"}]},
                        "x": {"type": "object", "properties": {"x": {"type": "boolean"}}},
                        "z": {"type": "object", "properties": {"z": {"type": "string"}}},
                        "y": {"type": "integer"}}}
    assert find_unenforceable(schema)
    out, done = rewrite_schema(schema)
    assert {r.rule for r in done} == {"allOf-merge"} and find_unenforceable(out) == []
    assert out["properties"] == {"x": {"type": "boolean"}, "y": {"$ref": "#/definitions/y"}}
    assert out["additionalProperties"] is False and "allOf" not in out
    assert_same_validity(schema, generated_instances() + [{"x": True}, {"x": 1}, {"z": "s"},
                                                          {"y": 2}, {"x": False, "y": 1}])


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


# MaskBench schemas that both backends refused before these rules; now served exactly:
# by xgrammar (its strict check passes) or by llguidance (its compile accepts the rewrite)
_NEWLY_SERVED = {
    "Github_hard---o61003": "xgrammar",  # oneOf: a required name the empty-object branch forbids
    "Github_ultra---o79009": "xgrammar",  # oneOf: to.reachable required by one, closed out
    "JsonSchemaStore---theme": "xgrammar",  # allOf merge of $ref parts and closed parts
    "Github_medium---o71265": "llguidance",  # oneOf: status "^success$" / "^fail$" / "^error$"
    "Glaiveai2K---calculate_area_2503b276": "llguidance",  # oneOf of required lists
    "Github_medium---o58776": "llguidance",  # minProperties 1 beside optional properties
    "JsonSchemaStore---vtestunit-schema": "llguidance",  # closed one-property oneOf branches
}


def _llguidance_error(schema: Any) -> str:
    """llguidance's (tokenizer-free) verdict on ``schema`` as it is, with the engine's
    options: its error, or "" when it would compile it."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides=json_options(any_whitespace=False, lenient=False))
    return llguidance.LLMatcher.validate_grammar(grammar)


def test_newly_served_maskbench_schemas() -> None:
    cases = dict(load_maskbench())
    for name, backend in _NEWLY_SERVED.items():
        schema = cases[name]["schema"]
        out, done = rewrite_schema(schema)
        # as sent, neither backend serves it exactly
        assert done and find_unenforceable(schema) and _llguidance_error(schema), name
        if backend == "xgrammar":
            assert find_unenforceable(out) == [], (name, find_unenforceable(out))
        else:
            assert _llguidance_error(out) == "", (name, _llguidance_error(out))


def test_rewritten_text_is_the_same_under_every_string_hash_seed() -> None:
    """The rewritten text is a compile cache key, shared by processes: the exclusive ``anyOf``
    of a ``oneOf`` of ``required`` lists must not follow a set's hash order."""
    import subprocess
    import sys

    path = "tests/data/maskbench/Glaiveai2K---calculate_area_2503b276.json"
    code = ("import json, sys; from structspec.grammar.schema_rewrite import rewrite_schema_text;"
            f"print(rewrite_schema_text(json.dumps(json.load(open({path!r}))['schema'])))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**__import__("os").environ,
                                            "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (0, 1, 2)}
    assert len(outs) == 1 and "anyOf" in next(iter(outs))
