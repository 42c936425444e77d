"""Which JSON Schema usages xgrammar 0.2.8 would silently weaken (the strict-mode check).

xgrammar compiles many schemas to a grammar that accepts *more* than the schema allows: it
drops some keywords without an error. A request that asked for ``strict: true`` must then be
refused instead of being given output that may not validate. :func:`find_unenforceable` lists
those usages so the backend can refuse them with a message naming the keyword and its JSON
pointer.

Every rule below was found empirically (``benchmarks/grammar_weakening.py`` runs the invalid
instances of the MaskBench / JSONSchemaBench schemas through xgrammar's strict grammar; the
mini schemas in ``tests/grammar/test_schema_check.py`` show each rule's weakening in isolation):

======================  ============================================================  =========
rule                    what xgrammar does                                           evidence
======================  ============================================================  =========
``not``                 ignored                                                       data
``allOf`` (>1 branch)   the whole node becomes "any JSON"                             data
composition siblings    keywords beside ``$ref``/``allOf``/``anyOf``/``oneOf`` ignored  data
``oneOf`` overlap       enforced as ``anyOf`` unless branches are provably disjoint   mini
dependencies            ``dependencies``/``dependentRequired``/``dependentSchemas``    data
``if``/``then``/``else``  ignored                                                       mini
``uniqueItems``         ignored                                                       mini
``contains`` (min/max)  ignored (``[""]`` passes ``contains: {const: "x"}``)            user
``multipleOf``          ignored unless the type is integer and the divisor an integer mini
pattern + length        ``minLength``/``maxLength`` ignored beside ``pattern``        data
format + pattern/len    ``pattern``/lengths ignored beside a known ``format``          mini
lookahead in pattern    the assertion is ignored                                     mini
unenforced ``format``   ``date``/``date-time`` calendar (2024-02-30), ``regex``,       data
                        ``iri``, ``iri-reference``, ``idn-email``, ``idn-hostname``
enum/const siblings     other keywords ignored (checked: rejected only if some value  mini
                        violates them)
undeclared required     a ``required`` name missing from ``properties`` is dropped    mini
======================  ============================================================  =========

Usages that xgrammar makes *stricter* than the schema (property order, compact enum values,
anchored ``pattern``, ``patternProperties``) are not reported: they lose valid
outputs but never admit an invalid one.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

from structspec.schema_structure import escape_pointer_token as _escape
from structspec.schema_structure import resolve_local_ref as _resolve

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$comment", "deprecated",
    "readOnly", "writeOnly", "$schema", "$id", "id", "$anchor", "definitions", "$defs",
    "contentEncoding", "contentMediaType", "contentSchema", "$vocabulary", "$dynamicAnchor",
})
"""Keywords that never constrain an instance (unknown keywords are ignored as well)."""

ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "contains", "minContains", "maxContains", "maxItems",
    "minItems", "uniqueItems", "maxProperties", "minProperties", "required", "properties",
    "patternProperties", "additionalProperties", "unevaluatedProperties", "dependentRequired",
    "dependentSchemas", "dependencies", "propertyNames", "allOf", "anyOf", "oneOf", "not", "if",
    "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
})
"""JSON Schema keywords (draft-04 … 2020-12) that constrain an instance."""

COMPOSITION = ("$ref", "allOf", "anyOf", "oneOf")

KNOWN_FORMATS = frozenset({
    "email", "uri", "uri-reference", "uuid", "date", "time", "date-time", "duration", "ipv4",
    "ipv6", "hostname", "json-pointer", "relative-json-pointer", "uri-template",
})
"""Formats xgrammar turns into a regex (any other value is ignored, as validators do)."""

UNENFORCED_FORMATS = {
    "date": "calendar validity is not enforced (e.g. 2024-02-30 is accepted)",
    "date-time": "calendar validity is not enforced (e.g. 2024-02-30T00:00:00Z is accepted)",
    "regex": "the string is not checked to be a regex",
    "iri": "the format is ignored",
    "iri-reference": "the format is ignored",
    "idn-email": "the format is ignored",
    "idn-hostname": "the format is ignored",
}

#: JSON pointers a refusal names at most (the rest are counted): the strict check's and
#: llguidance's "Unimplemented keys" refusals alike
MAX_POINTERS_SHOWN = 5
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
#: subschemas xgrammar never reads: the keywords holding them are reported where they are used
#: (``'not' is ignored ...``), or have no effect (``if`` without ``then``/``else``), so what is
#: inside them is not checked (it only repeated the refusal, or refused what is enforced)
_UNUSED_SUBSCHEMAS = frozenset({"not", "if", "then", "else", "dependencies", "dependentSchemas"})
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_SINGLE = ("additionalProperties", "additionalItems", "unevaluatedItems",
                  "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then",
                  "else")


def find_unenforceable(schema: dict[str, Any] | bool) -> list[tuple[str, str]]:
    """List the usages in ``schema`` that xgrammar 0.2.8 would enforce only partially.

    Walks every subschema reachable from the root (local ``$ref`` targets included, each once;
    unreferenced ``definitions`` are not visited), but not those inside keywords xgrammar
    never reads (``not``, ``if``/``then``/``else``, ``dependencies``, ``dependentSchemas``:
    the keyword itself is reported where it matters).

    Args:
        schema: a parsed JSON Schema (dict or boolean schema).

    Returns:
        ``[(json_pointer, reason), ...]`` in document-walk order; empty when the grammar
        enforces the schema exactly (up to the stricter-than-schema usages noted in the module
        docstring). Each reason names the keyword, e.g. ``"'not' is ignored by the grammar
        engine"``.
    """
    from structspec.grammar.bounded_validator import pattern_budget

    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    with pattern_budget():  # the enum/const checks' regex searches, for the whole schema
        for pointer, node in _walk(schema, schema, "", seen, _UNUSED_SUBSCHEMAS):
            found.extend((pointer, reason) for reason in _node_problems(node, schema))
    return found


# ---------------------------------------------------------------------------------------------
# Walking
# ---------------------------------------------------------------------------------------------


def keyword_pointers(schema: Any, keywords: Iterable[str]) -> list[str]:
    """JSON pointers of every use of ``keywords`` as a keyword in ``schema``: each subschema
    reachable from the root (local ``$ref`` targets included; unlike
    :func:`find_unenforceable`, those inside ``not``, ``if``/``then``/``else`` and
    ``dependencies`` too) that has one of them as a key, e.g. ``/properties/tags/uniqueItems``;
    property names are not keywords. In document-walk order; empty when none is used (or
    ``schema`` is not an object)."""
    wanted = set(keywords)
    return [f"{pointer}/{_escape(key)}" for pointer, node in _walk(schema, schema, "", set())
            for key in node if key in wanted]


def _walk(node: Any, root: Any, pointer: str, seen: set[str],
          skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, dict]]:
    """Every subschema reachable from ``node`` as ``(json_pointer, subschema)``, each pointer
    once (local ``$ref`` targets at their own pointer), not descending into the keywords in
    ``skip``."""
    if not isinstance(node, dict) or pointer in seen:
        return
    seen.add(pointer)
    yield pointer, node
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict) and key not in skip:
            for name, child in sub.items():
                yield from _walk(child, root, f"{pointer}/{key}/{_escape(name)}", seen, skip)
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield from _walk(child, root, f"{pointer}/{key}/{i}", seen, skip)
    for key in _SCHEMA_SINGLE:
        if key not in skip:
            yield from _walk(node.get(key), root, f"{pointer}/{key}", seen, skip)
    items = node.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield from _walk(child, root, f"{pointer}/items/{i}", seen, skip)
    else:
        yield from _walk(items, root, f"{pointer}/items", seen, skip)
    deps = node.get("dependencies")
    if isinstance(deps, dict) and "dependencies" not in skip:
        for name, child in deps.items():
            yield from _walk(child, root, f"{pointer}/dependencies/{_escape(name)}", seen, skip)
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is not None:
            yield from _walk(target[1], root, target[0], seen, skip)


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


def _node_problems(node: dict[str, Any], root: Any) -> Iterator[str]:
    keys = set(node)
    if "not" in keys:
        yield "'not' is ignored by the grammar engine"
    for key in ("$dynamicRef", "$recursiveRef"):
        if key in keys:
            yield f"'{key}' is not resolved by the grammar engine (it accepts any JSON there)"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref[1:2] not in ("", "/"):
        yield (f"a '$ref' to an anchor ({ref!r}) is not resolved by the grammar engine (it "
               "accepts any JSON there); point it at the definition ('#/$defs/...')")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield "'allOf' with more than one subschema is not enforced (it accepts any JSON)"
    present = [k for k in COMPOSITION if k in keys]
    if present:
        siblings = sorted((keys & ASSERTIONS) - {present[0]})
        if siblings:
            yield (f"keywords beside '{present[0]}' are ignored by the grammar engine: "
                   + ", ".join(repr(s) for s in siblings))
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _provably_disjoint(one_of, root):
        yield ("'oneOf' branches may overlap; the grammar engine enforces it as 'anyOf' "
               "(an instance matching two branches would be accepted)")
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if key in keys:
            yield f"'{key}' is ignored by the grammar engine"
    if "if" in keys and ("then" in keys or "else" in keys):
        yield "'if'/'then'/'else' is ignored by the grammar engine"
    if node.get("uniqueItems") is True:
        yield "'uniqueItems' is ignored by the grammar engine"
    # xgrammar 0.2.8 compiles 'contains' to a plain array: [""] passes {"contains": {"const":
    # "x"}} (checked with its matcher), so it is a weakening, not a stricter rule
    for key in sorted(keys & {"contains", "minContains", "maxContains"}):
        yield f"'{key}' is ignored by the grammar engine"
    if "multipleOf" in keys and not _integer_multiple_of(node):
        yield ("'multipleOf' is enforced only for type 'integer' with an integer divisor; "
               "here it would be ignored")
    fmt = node.get("format")
    known_format = isinstance(fmt, str) and fmt in KNOWN_FORMATS
    lengths = sorted(keys & {"minLength", "maxLength"})
    if "pattern" in keys and lengths and not known_format:
        yield f"{', '.join(repr(k) for k in lengths)} beside 'pattern' are ignored"
    if known_format:
        beside = sorted(keys & {"pattern", "minLength", "maxLength"})
        if beside:
            yield f"{', '.join(repr(k) for k in beside)} beside 'format' are ignored"
    if isinstance(fmt, str) and fmt in UNENFORCED_FORMATS:
        yield f"'format': {fmt!r}: {UNENFORCED_FORMATS[fmt]}"
    pattern = node.get("pattern")
    if isinstance(pattern, str) and ("(?=" in pattern or "(?!" in pattern):
        yield "lookahead assertions in 'pattern' are ignored by the grammar engine"
    if "enum" in keys or "const" in keys:
        problem = _enum_sibling_problem(node, "const" if "const" in keys else "enum")
        if problem is not None:
            yield problem
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties")
        declared = set(props) if isinstance(props, dict) else set()
        missing = [r for r in required if isinstance(r, str) and r not in declared]
        if missing and not present:
            yield ("'required' names not declared in 'properties' are dropped: "
                   + ", ".join(repr(m) for m in missing))


def _integer_multiple_of(node: dict[str, Any]) -> bool:
    divisor = node["multipleOf"]
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or "integer" not in types or "number" in types:
        return False
    return isinstance(divisor, int) or (isinstance(divisor, float) and divisor.is_integer())


def _enum_sibling_problem(node: dict[str, Any], key: str) -> str | None:
    """Why the ``enum``/``const`` values of ``node`` (``key`` names which) cannot be served
    exactly beside the keywords next to them, or None when every value satisfies them: the
    grammar engine keeps the values and ignores the rest. Regex searches are time-limited (a
    client's pattern must not stall the engine, :mod:`~structspec.grammar.bounded_validator`)."""
    siblings = {k: v for k, v in node.items() if k in ASSERTIONS and k not in ("enum", "const")}
    if not siblings:
        return None
    ignored = f"keywords beside '{key}' are ignored"
    if any(k in siblings for k in COMPOSITION) or "$ref" in repr(siblings):
        # cannot validate without the whole document; be conservative
        return (f"{ignored} and the {key} values cannot be checked against them here (a "
                "'$ref' or a composition among them)")
    values = list(node.get("enum") or []) + ([node["const"]] if "const" in node else [])
    from structspec.grammar.bounded_validator import PatternTimeLimit, bounded_validator

    try:
        validator = bounded_validator(siblings)
        if validator is not None and all(validator.is_valid(v) for v in values):
            return None
    except PatternTimeLimit:
        return (f"{ignored} and a 'pattern' among them takes too long to check the {key} "
                "values against")
    except Exception:  # noqa: BLE001 - a malformed sibling: let the compiler report it
        pass
    return f"{ignored} and some {key} values violate them"


_NUMERIC = {"integer", "number"}


def _types_of(node: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a subschema can accept, or ``None`` when unknown (= any type)."""
    if depth > 16 or not isinstance(node, dict):
        return None
    if "const" in node:
        return {_type_of_value(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_type_of_value(v) for v in node["enum"]}
    t = node.get("type")
    if isinstance(t, str):
        return {t} | ({"integer"} if t == "number" else set())
    if isinstance(t, list):
        out = set(t)
        return out | ({"integer"} if "number" in out else set())
    if isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        return None if target is None else _types_of(target[1], root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            parts = [_types_of(b, root, depth + 1) for b in node[key]]
            return None if any(p is None for p in parts) else set().union(*parts)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
        return _types_of(node["allOf"][0], root, depth + 1)
    return None


def _type_of_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _deref(node: Any, root: Any) -> Any:
    for _ in range(16):
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = _resolve(root, node["$ref"])
            if target is None:
                return node
            node = target[1]
        else:
            return node
    return node


def _provably_disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two ``oneOf`` branches (so ``anyOf`` is exact).

    Two proofs are tried: disjoint JSON types, or a discriminator property that every branch
    requires and restricts to pairwise-disjoint ``const``/``enum`` values.
    """
    types = [_types_of(b, root) for b in branches]
    if all(t is not None for t in types) and all(
        not (a & b) for a, b in itertools.combinations(types, 2)  # type: ignore[operator]
    ):
        return True
    resolved = [_deref(b, root) for b in branches]
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in resolved):
        return False
    common = set.intersection(*(set(b["properties"]) for b in resolved))
    for prop in sorted(common):
        value_sets = []
        for b in resolved:
            if prop not in (b.get("required") or []):
                break
            sub = _deref(b["properties"][prop], root)
            if not isinstance(sub, dict):
                break
            if "const" in sub:
                value_sets.append([sub["const"]])
            elif isinstance(sub.get("enum"), list):
                value_sets.append(sub["enum"])
            else:
                break
        else:
            keys = [{_value_key(v) for v in vs} for vs in value_sets]
            if all(not (a & b) for a, b in itertools.combinations(keys, 2)):
                return True
    return False


def _value_key(v: Any) -> str:
    return json.dumps(v, sort_keys=True)
