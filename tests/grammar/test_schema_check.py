"""The strict-mode enforceability check against xgrammar's actual behaviour.

Two kinds of evidence:

* one mini test per rule: a small schema whose strict grammar accepts an invalid instance
  (the weakening, shown on xgrammar itself), which ``find_unenforceable`` must report, plus a
  near variant that xgrammar enforces exactly and the check must let through (the rule is
  narrow);
* the MaskBench sweep: for every schema that compiles and passes the check, no invalid
  instance is accepted by the grammar.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend, GrammarError, find_unenforceable
from structspec.grammar.schema_rewrite import rewrite_schema

from .conftest import STOP_ID, fast_compile_names

jsonschema = pytest.importorskip("jsonschema")  # absent on the GPU host only

SEP = (", ", ": ")  # xgrammar's separators with any_whitespace=False

DEFS = {"p": {"type": "integer"}}
OBJ_DEFS = {"p": {"type": "object", "properties": {"a": {"type": "integer"}}}}

# rule -> (weakened schema, an instance it must reject but xgrammar accepts, a close variant
#          that is enforced exactly and must pass the check)
RULES: dict[str, tuple[dict[str, Any], Any, dict[str, Any]]] = {
    "not": ({"type": "integer", "not": {"enum": [1]}}, 1,
            {"type": "integer", "enum": [2, 3]}),
    "allOf with several subschemas": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "a",
                                      {"allOf": [{"type": "integer", "minimum": 3}]}),
    "keywords beside $ref": ({"definitions": DEFS, "$ref": "#/definitions/p", "minimum": 5}, 1,
                             {"definitions": DEFS, "$ref": "#/definitions/p",
                              "description": "annotations are fine"}),
    "keywords beside allOf": ({"definitions": OBJ_DEFS, "allOf": [{"$ref": "#/definitions/p"}],
                               "required": ["a"]}, {},
                              {"definitions": OBJ_DEFS, "allOf": [{"$ref": "#/definitions/p"}]}),
    "keywords beside anyOf": ({"minProperties": 1,
                               "anyOf": [{"type": "string"}, {"type": "object"}]}, {},
                              {"anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "integer"}]}),
    "oneOf with overlapping branches": ({"oneOf": [{"type": "integer"},
                                                   {"type": "number", "minimum": 0}]}, 5,
                                        {"oneOf": [{"type": "integer"}, {"type": "string"}]}),
    "oneOf without a discriminator": (
        {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                   {"type": "object", "properties": {"b": {"type": "integer"}}}]}, {},
        {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
                   {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"]}]}),
    "dependencies": ({"$schema": "http://json-schema.org/draft-07/schema#",
                      "type": "object", "properties": {"a": {"type": "string"},
                                                       "b": {"type": "string"}},
                      "dependencies": {"a": ["b"]}}, {"a": "x"},
                     {"type": "object", "properties": {"a": {"type": "string"},
                                                       "b": {"type": "string"}},
                      "required": ["a", "b"]}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "string"},
                                                            "b": {"type": "string"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": "x"},
                          {"type": "object", "properties": {"a": {"type": "string"}}}),
    "if/then": ({"type": "object", "properties": {"a": {"type": "integer"},
                                                  "b": {"type": "integer"}},
                 "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
                 "then": {"required": ["b"]}}, {"a": 1},
                {"type": "object", "properties": {"a": {"type": "integer"}}}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1],
                    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False}),
    "contains": ({"type": "array", "items": {"type": "string"}, "contains": {"const": "x"}},
                 [""], {"type": "array", "items": {"type": "string"}, "minItems": 1}),
    "multipleOf on numbers": ({"type": "number", "multipleOf": 0.5}, 1.2,
                              {"type": "integer", "multipleOf": 3}),
    "length beside pattern": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab",
                              {"type": "string", "pattern": "^[a-z]{3,}$"}),
    "length beside format": ({"type": "string", "format": "email", "minLength": 50}, "a@b.com",
                             {"type": "string", "format": "password", "minLength": 3}),
    "lookahead in pattern": ({"type": "string", "pattern": "^(?!foo).*$"}, "foo",
                             {"type": "string", "pattern": "^(?:foo|bar)$"}),
    "format date": ({"type": "string", "format": "date"}, "2024-02-30",
                    {"type": "string", "format": "time"}),
    "format regex": ({"type": "string", "format": "regex"}, "(",
                     {"type": "string", "format": "uuid"}),
    "keywords beside enum": ({"type": "integer", "enum": [1, 7], "minimum": 5}, 1,
                             {"type": "integer", "enum": [5, 7], "minimum": 5}),
    "undeclared required": ({"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["b"]}, {"a": 1},
                            {"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["a"]}),
}

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _is_valid(schema: Any, instance: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=FORMAT_CHECKER).is_valid(instance)


def _accepts(compiled: xgr.CompiledGrammar, instance: Any) -> bool:
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[STOP_ID])
    return m.accept_string(json.dumps(instance, separators=SEP)) and m.is_completed()


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_shows_weakening_and_is_narrow(backend: GrammarBackend, rule: str) -> None:
    schema, invalid, variant = RULES[rule]
    assert not _is_valid(schema, invalid)
    # xgrammar itself on the schema as written (the backend would rewrite it first)
    weak = xgr.GrammarCompiler(backend.tokenizer_info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert _accepts(weak, invalid), f"{rule}: xgrammar no longer weakens this; drop the rule"
    assert find_unenforceable(schema), rule
    rewritten, done = rewrite_schema(schema)
    if done and not find_unenforceable(rewritten):
        # an exact rewrite (structspec/grammar/schema_rewrite.py) makes it enforceable: the
        # strict grammar now rejects the instance xgrammar accepted
        exact = backend.compile(JsonSchemaConstraint(schema, strict=True))
        assert not _accepts(exact, invalid), rule
    else:
        with pytest.raises(GrammarError) as info:
            backend.compile(JsonSchemaConstraint(schema, strict=True))
        assert info.value.param == "json_schema"
        assert "strict" in str(info.value)
    assert find_unenforceable(variant) == [], rule
    backend.compile(JsonSchemaConstraint(variant, strict=True))  # compiles


def test_reports_pointer_and_keyword() -> None:
    schema = {"type": "object", "properties": {"x/y": {"type": "integer", "not": {"const": 1}}},
              "definitions": {"unused": {"not": {}}}}
    assert find_unenforceable(schema) == [("/properties/x~1y", "'not' is ignored by the "
                                           "grammar engine")]
    ref = {"$ref": "#/definitions/a", "definitions": {"a": {"uniqueItems": True}}}
    [(pointer, reason)] = find_unenforceable(ref)
    assert pointer == "/definitions/a" and "uniqueItems" in reason


def test_subschemas_xgrammar_never_reads_are_not_checked(backend: GrammarBackend) -> None:
    """What sits inside ``not``, ``if``/``then``/``else`` or ``dependencies`` is not checked:
    the keyword is reported where it is used, and the problems inside only repeated the
    refusal (``/if: 'required' names not declared ...`` for a name the root declares); an
    ``if`` without ``then``/``else`` has no effect, and what it holds is no weakening: the
    grammar agrees with the validator."""
    ite = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
           "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    assert find_unenforceable(ite) == [("", "'if'/'then'/'else' is ignored by the grammar "
                                            "engine")]
    neg = {"type": "array", "not": {"uniqueItems": True, "items": {"not": {}}}}
    assert find_unenforceable(neg) == [("", "'not' is ignored by the grammar engine")]
    lone = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
            "required": ["a"], "additionalProperties": False,
            "if": {"properties": {"a": {"uniqueItems": True}}}}
    assert find_unenforceable(lone) == []
    compiled = backend.compile(JsonSchemaConstraint(lone, strict=True))
    for instance in ({"a": [1, 1]}, {"a": [1]}, {}, {"a": 1}, {"a": [1], "b": 2}):
        assert _accepts(compiled, instance) == _is_valid(lone, instance), instance


def test_refusal_of_a_rewrite_names_the_clients_keyword(backend: GrammarBackend) -> None:
    """xgrammar cannot enforce the exact rewrite of ``dependentRequired`` (an ``allOf`` of an
    ``anyOf`` beside the properties): the strict refusal's pointers are the rewrite's, so it
    says so and names the client's keyword and where it was; a refusal of the client's own
    keyword does not. The engine's compile and the command line's precheck alike."""
    from structspec.grammar.precheck import check_grammar

    dependent = {"type": "object", "properties": {"a": {"type": "string"},
                                                  "b": {"type": "string"}},
                 "dependentRequired": {"a": ["b"]}}
    plain = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    for refuse in (lambda s: backend.compile(JsonSchemaConstraint(s, strict=True)),
                   lambda s: check_grammar(JsonSchemaConstraint(s, strict=True))):
        with pytest.raises(GrammarError) as info:
            refuse(dependent)
        assert "/allOf/0/anyOf/1" in str(info.value), str(info.value)
        assert ("(these name the engine's exact rewrite of 'dependentRequired' at /, which "
                "xgrammar does not enforce; the llguidance grammar backend may)"
                in str(info.value)), str(info.value)
        with pytest.raises(GrammarError) as info:
            refuse(plain)
        assert "/properties/t: 'uniqueItems'" in str(info.value)
        assert "rewrite" not in str(info.value), str(info.value)


def _sweep(backend: GrammarBackend, cases: list[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    t0 = time.perf_counter()
    passing = [(n, c) for n, c in cases if not find_unenforceable(c["schema"])]
    futures = [(n, c, backend.submit(JsonSchemaConstraint(c["schema"], strict=True)))
               for n, c in passing]
    compiled = invalid = accepted = 0
    bad = []
    for name, case, fut in futures:
        try:
            cg = fut.result(timeout=300)
        except GrammarError:
            continue
        compiled += 1
        for t in case["tests"]:
            if t["valid"]:
                continue
            invalid += 1
            if _accepts(cg, t["data"]):
                accepted += 1
                bad.append(f"{name}: {json.dumps(t['data'])[:120]}")
    stats = {"cases": len(cases), "rejected_by_check": len(cases) - len(passing),
             "passing_and_compiling": compiled, "invalid_instances": invalid,
             "invalid_accepted": accepted}
    print(f"\nschema_check sweep: {stats} in {time.perf_counter() - t0:.1f}s")
    assert not bad, "invalid instances accepted by schemas that pass the check:\n" + "\n".join(bad)
    return stats


def test_maskbench_no_weakening_after_check(
        backend: GrammarBackend, maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    fast = fast_compile_names()
    stats = _sweep(backend, [(n, c) for n, c in maskbench if n in fast])
    assert stats["invalid_instances"] > 300
    # Not wholesale: every rule has a mini test above showing its weakening; over all 365
    # cases the check rejects 89 (benchmarks/grammar_weakening.py prints the per-rule table).
    assert stats["rejected_by_check"] <= 89


@pytest.mark.slow
def test_maskbench_no_weakening_after_check_all(
        backend: GrammarBackend, maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    _sweep(backend, maskbench)


def test_check_is_fast(maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as ex:
        list(ex.map(lambda c: find_unenforceable(c[1]["schema"]), maskbench))
    assert time.perf_counter() - t0 < 2.0


def test_refs_the_grammar_does_not_resolve_are_refused() -> None:
    """xgrammar resolves JSON-pointer ``$ref``s only: a ``$ref`` to an ``$anchor``, a
    ``$dynamicRef`` and a ``$recursiveRef`` let any JSON through there, so strict mode refuses
    them (a fresh user's strict tool call generated ``{"a": "you"}`` for an integer anchor)."""
    anchor = {"type": "object", "$defs": {"X": {"$anchor": "xx", "type": "integer"}},
              "properties": {"a": {"$ref": "#xx"}}, "required": ["a"]}
    dynamic = {"type": "object", "properties": {"a": {"$dynamicRef": "#node"}}}
    recursive = {"type": "object", "properties": {"a": {"$recursiveRef": "#"}}}
    pointer = {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}, "b": {"$ref": "#"}},
               "$defs": {"X": {"type": "integer"}}}
    assert [p for p, _ in find_unenforceable(anchor)] == ["/properties/a"]
    assert "anchor" in find_unenforceable(anchor)[0][1]
    assert [p for p, _ in find_unenforceable(dynamic)] == ["/properties/a"]
    assert [p for p, _ in find_unenforceable(recursive)] == ["/properties/a"]
    assert find_unenforceable(pointer) == []
