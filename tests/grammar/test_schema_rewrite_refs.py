"""Local ``$ref`` spellings the backends do not resolve alike (schema_rewrite_refs.py): a key
with a space, ``/``, ``~`` or a non-ASCII letter, percent-encoded, and an array index. The
rewrite must keep every instance's validity (``jsonschema``), and both backends must then
compile the schema and enforce the referenced subschema (instances fed as tokens)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar.llg_compile import json_options
from structspec.grammar.schema_rewrite import rewrite_schema, rewrite_schema_text
from structspec.grammar.schema_rewrite_refs import DEF_PREFIX, plain_ref
from structspec.schema_structure import find_structure_problem, resolve_local_ref
from tests.grammar.conftest import STOP_ID

_INT = {"type": "integer"}


def _one_ref(key: str, ref: str) -> dict[str, Any]:
    return {"$defs": {key: _INT}, "type": "object", "properties": {"x": {"$ref": ref}},
            "required": ["x"], "additionalProperties": False}


CASES: dict[str, dict[str, Any]] = {
    "space": _one_ref("a b", "#/$defs/a%20b"),
    "space-unencoded": _one_ref("a b", "#/$defs/a b"),
    "slash": _one_ref("a/b", "#/$defs/a~1b"),
    "tilde": _one_ref("a~b", "#/$defs/a~0b"),
    "percent-and-tilde": _one_ref("50%/x", "#/$defs/50%25~1x"),
    "non-ascii": _one_ref("é", "#/$defs/%C3%A9"),
    "definitions": {"definitions": {"Foo Bar": _INT}, "type": "object",
                    "properties": {"x": {"$ref": "#/definitions/Foo%20Bar"}},
                    "required": ["x"], "additionalProperties": False},
    "array-index": {"type": "object", "required": ["x"], "additionalProperties": False,
                    "properties": {"x": {"$ref": "#/allOf/0/properties/y"}},
                    "allOf": [{"properties": {"y": _INT}}]},
    "recursive": {"$defs": {"node n": {"type": "object", "required": ["x"],
                                       "additionalProperties": False, "properties": {
                                           "x": _INT, "kids": {"type": "array", "items": {
                                               "$ref": "#/$defs/node%20n"}}}}},
                  "$ref": "#/$defs/node%20n"},
}

VALID = [{"x": 5}, {"x": -3}, {"x": 1, "kids": [{"x": 2}, {"x": 3, "kids": []}]}]
INVALID = [{"x": "5"}, {"x": 1.5}, {"x": None}, {}, {"x": 1, "kids": [{"x": "a"}]},
           {"x": 1, "kids": [{}]}]


def _instances(name: str) -> tuple[list[Any], list[Any]]:
    schema = CASES[name]
    check = jsonschema.Draft202012Validator(schema)
    everything = VALID + INVALID
    return ([i for i in everything if check.is_valid(i)],
            [i for i in everything if not check.is_valid(i)])


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrite_points_at_plain_copies_and_keeps_validity(name: str) -> None:
    schema = CASES[name]
    out, done = rewrite_schema(schema)
    assert "ref-pointer" in {r.rule for r in done}
    valid, invalid = _instances(name)
    assert valid and invalid
    after = jsonschema.Draft202012Validator(out)
    assert all(after.is_valid(i) for i in valid) and not any(after.is_valid(i) for i in invalid)
    refs = [r for r in json.dumps(out).split('"$ref": ')[1:]]
    assert refs and all(r.startswith(f'"#/$defs/{DEF_PREFIX}') for r in refs), out
    assert find_structure_problem(schema) is None  # not a false 400 (percent-decoded)


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_backends_enforce_the_rewritten_refs(name: str, backend: Any, llg_backend: Any,
                                                  hf_tokenizer: Any) -> None:
    """xgrammar (strict check passed) and llguidance compile the rewrite; fed as tokens, each
    accepts the valid instances and refuses the invalid ones."""
    text = rewrite_schema_text(json.dumps(CASES[name]))
    xgr.Grammar.from_json_schema(text, strict_mode=True)  # raised before the rewrite
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        text, overrides=json_options(any_whitespace=False, lenient=False))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    valid, invalid = _instances(name)
    for be in (backend, llg_backend):
        compiled = be.compile(JsonSchemaConstraint(CASES[name]), timeout=60)
        for inst in valid + invalid:
            ids = hf_tokenizer.encode(json.dumps(inst, separators=(", ", ": ")),
                                      add_special_tokens=False) + [STOP_ID]
            m = be.create_matcher(compiled)
            accepted = m.accept_run(ids) == len(ids) and m.is_terminated()
            assert accepted is (inst in valid), (name, type(be).__name__, inst)


def test_plain_refs_are_left_alone() -> None:
    k8s = "https:__kubernetesjsonschema_dev_master__defs_json_defs_io.k8s.api(v1)@x"
    schema = {"$defs": {k8s: _INT}, "properties": {"x": {"$ref": f"#/$defs/{k8s}"},
                                                  "y": {"$ref": "#"}}}
    assert plain_ref(schema, f"#/$defs/{k8s}") and plain_ref(schema, "#")
    assert rewrite_schema(schema) == (schema, [])


def test_copy_names_avoid_existing_definitions() -> None:
    schema = {"$defs": {f"{DEF_PREFIX}0": {"type": "string"}, "a b": _INT},
              "properties": {"x": {"$ref": "#/$defs/a%20b"},
                             "y": {"$ref": f"#/$defs/{DEF_PREFIX}0"}}}
    out, _ = rewrite_schema(schema)
    assert out["properties"]["x"] == {"$ref": f"#/$defs/{DEF_PREFIX}1"}
    assert out["$defs"][f"{DEF_PREFIX}0"] == {"type": "string"}
    assert out["properties"]["y"] == {"$ref": f"#/$defs/{DEF_PREFIX}0"}


@pytest.mark.parametrize("schema", [
    # a nested base URI: a reference below it may resolve elsewhere
    {"$defs": {"a b": {"$id": "http://example.com/x", "type": "integer"}},
     "properties": {"x": {"$ref": "#/$defs/a%20b"}}},
    # a root $defs that is not an object
    {"$defs": [1], "definitions": {"a b": _INT}, "properties": {"x": {
        "$ref": "#/definitions/a%20b"}}},
    # dangling: the structure check refuses it, naming it
    {"$defs": {"a b": _INT}, "properties": {"x": {"$ref": "#/$defs/a%2Fb"}}},
    # "$ref" as data is not a reference
    {"properties": {"x": {"const": {"$ref": "#/$defs/a%20b"}}}},
])
def test_unsafe_or_meaningless_refs_are_left_alone(schema: dict[str, Any]) -> None:
    assert rewrite_schema(schema) == (schema, [])


def test_percent_decoding_before_the_pointer() -> None:
    """``%2F`` decodes to ``/`` before the pointer is split (RFC 3986, then RFC 6901): it
    separates tokens, as ``jsonschema`` reads it; ``~1`` is the escaped ``/``."""
    root = {"$defs": {"a/b": 1, "a": {"b": 2}}}
    assert resolve_local_ref(root, "#/$defs/a%2Fb") == ("/$defs/a/b", 2)
    assert resolve_local_ref(root, "#/$defs/a~1b") == ("/$defs/a~1b", 1)
    assert resolve_local_ref(root, "#name") is None  # an anchor, not a pointer
    assert find_structure_problem({"$defs": {"a b": {}}, "$ref": "#/$defs/a%20c"}) is not None
