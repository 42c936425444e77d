"""Exact rewrites of JSON Schema usages that neither grammar backend enforces, into forms
they do (:func:`rewrite_schema`).

Every rule below replaces a subschema by one that accepts **exactly the same instances**
(``tests/grammar/test_schema_rewrite.py`` checks each rule with ``jsonschema`` on the MaskBench
instances and on generated ones); a usage no rule covers is left alone, and the backends
refuse it as before, naming its JSON pointer. The rewrite runs before the strict check and
the compile of both backends, on the schema's canonical text (``schema_text``), so the
compile cache, the strict check's pointers and both backends see the same schema.

==========================  ================================================================
rule                        rewrite (why it is exact)
==========================  ================================================================
``format`` annotation       a ``format`` value that is not a format of the JSON Schema
                            vocabulary and that neither backend implements (``color``,
                            ``int32``, ``path``...) is dropped: in 2019-09 and later ``format``
                            is an annotation unless a validator opts in to assert it, and no
                            validator asserts a format it does not know
``enum``/``const`` filter   a subschema whose values are restricted to a finite list (its own
                            ``enum``/``const``, or one ``allOf`` branch's) becomes
                            ``{"enum": [the listed values the whole subschema accepts]}``:
                            each value is checked with ``jsonschema`` against the subschema
                            (``not``, ``allOf``, ``$ref``... included)
a lone ``if``               ``if`` without ``then``/``else``, or ``then``/``else`` without
                            ``if``, is dropped: it has no effect on validation (2020-12 §10.2.2;
                            draft-04/06 do not know the keywords at all)
``not`` of ``not``          ``{"not": {"not": S}}`` becomes ``{"allOf": [S]}``
``not`` of ``type``         the complementary type list, intersected with the node's ``type``
                            (skipped when the complement would be "number but not integer")
``not`` of ``required``     ``not: {required: [p]}``: the instance is an object without ``p``:
                            ``type`` object and ``properties.p: false``
``not`` of                  ``not: {propertyNames: {not: {const: c}}}``: an object with a
``propertyNames``           property ``c``: ``type`` object and ``required`` ``c``
``oneOf`` -> ``anyOf``      when the branches are pairwise disjoint (types, a discriminator
                            property, or a finite branch none of whose values the other
                            accepts, checked with ``jsonschema``), or there is one branch
``dependencies``,           ``{a: [b, ...]}``: ``b, ...`` added to ``required`` when ``a`` is
``dependentRequired``,      required, else ``anyOf [{properties: {a: false}},
``dependentSchemas``        {required: [a, b, ...]}]`` appended to ``allOf``; ``{a: S}``: ``S``
                            appended to ``allOf`` when ``a`` is required, else ``anyOf
                            [{properties: {a: false}}, {allOf: [{required: [a]}, S]}]``
==========================  ================================================================

Rewrites that remove a subtree are skipped when a ``$ref`` points into it, or when the
schema uses ``unevaluatedProperties``/``unevaluatedItems`` (their result depends on which
subschemas evaluated a property, which the rewrites change) or dynamic references.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from structspec.grammar.bounded_validator import (
    PatternTimeLimit,
    bounded_validator,
    pattern_budget,
)
from structspec.grammar.schema_check import ASSERTIONS, KNOWN_FORMATS, UNENFORCED_FORMATS
from structspec.grammar.schema_check import _provably_disjoint as _disjoint_by_check
from structspec.schema_structure import escape_pointer_token as _escape
from structspec.schema_structure import resolve_local_ref

STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex",
})
"""The formats of the JSON Schema 2020-12 vocabulary (kept: a user may expect them asserted;
a backend that does not enforce one refuses it)."""

LLGUIDANCE_FORMATS = frozenset({
    "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
})
"""Formats llguidance 1.9 turns into a regex."""

KEPT_FORMATS = STANDARD_FORMATS | KNOWN_FORMATS | LLGUIDANCE_FORMATS | frozenset(
    UNENFORCED_FORMATS)
"""Every ``format`` value some backend or the standard knows; any other is dropped."""

MAX_ENUM_VALUES = 512
"""Largest finite value list the ``enum``/``const`` filter checks (one ``jsonschema``
validation per value)."""

_TYPES = ("null", "boolean", "object", "array", "string", "integer", "fraction")
"""JSON instance types, with numbers split into integers and non-integers ("fraction")."""

_NOT_REWRITTEN = frozenset({"unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
                            "$recursiveRef"})
_ID_KEYS = ("$id", "$anchor", "$dynamicAnchor")

_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "definitions", "$defs")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_SINGLE = ("additionalProperties", "additionalItems", "unevaluatedItems",
                  "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then",
                  "else")


@dataclass(frozen=True)
class Rewrite:
    """One rewrite applied: where and which rule.

    Attributes:
        pointer: the JSON pointer of the rewritten subschema (``""`` = the root).
        rule: the rule's name (``format``, ``enum-filter``, ``not-not``, ``not-type``,
            ``not-required``, ``not-propertyNames``, ``oneOf-disjoint``, ``dependencies``,
            ``dependentRequired``, ``dependentSchemas``, ``lone-if``).
        detail: what was done, for logs and tests.
    """

    pointer: str
    rule: str
    detail: str


def rewrite_schema(schema: Any) -> tuple[Any, list[Rewrite]]:
    """Rewrite the usages of the module docstring's table into exactly equivalent ones.

    Args:
        schema: a parsed JSON Schema (dict or boolean); not modified.

    Returns:
        ``(rewritten schema, rewrites applied)``; the schema is ``schema`` itself when no rule
        applied.
    """
    if not isinstance(schema, dict) or _uses(schema, _NOT_REWRITTEN):
        return schema, []
    root = copy.deepcopy(schema)
    done: list[Rewrite] = []
    ctx = _Context(root, _local_refs(root))
    for pointer, node in list(_with_ref_targets(ctx)):
        for rule in _RULES:
            rule(ctx, pointer, node, done)
    return (root, done) if done else (schema, [])


@functools.lru_cache(maxsize=256)
def rewrite_schema_text(text: str) -> str:
    """:func:`rewrite_schema` of a schema's JSON text, as compact JSON text (key order kept);
    ``text`` itself when no rule applies or it is not JSON. Cached: the xgrammar and the
    llguidance compile of one schema (``auto``) rewrite it once."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # the caller's parse reports it
    with pattern_budget():  # the enum filter's and the disjointness checks' regex searches
        out, done = rewrite_schema(schema)
    if not done:
        return text
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Walking
# ---------------------------------------------------------------------------------------------


class _Context:
    """The document being rewritten and what the rules need to know about it."""

    def __init__(self, root: dict[str, Any], refs: list[tuple[str, str]]) -> None:
        self.root = root
        self.refs = refs  # (pointer of the $ref, its target as a JSON pointer)
        self._validator: Any = None

    def referenced_under(self, pointer: str, *, inside: tuple[str, ...] = ()) -> bool:
        """Whether a ``$ref`` points at ``pointer`` or into it, other than one that lies
        under one of the ``inside`` pointers (removed together with its target)."""
        return any((t == pointer or t.startswith(pointer + "/"))
                   and not any(s == p or s.startswith(p + "/") for p in inside)
                   for s, t in self.refs)

    def validator(self, node: Any) -> Any | None:
        """A ``jsonschema`` validator of ``node`` that resolves ``$ref`` in the whole document
        (the draft of its ``$schema``, 2020-12 without one; its regex searches time-limited:
        :mod:`~structspec.grammar.bounded_validator`), or None for a node with an assertion
        keyword that draft does not implement (its meaning would be ambiguous), or for a
        document whose regex keywords cannot be bounded."""
        if self._validator is None:
            self._validator = bounded_validator(self.root) or False
        if self._validator is False:
            return None
        if isinstance(node, dict):
            unknown = (set(node) & ASSERTIONS) - set(self._validator.VALIDATORS)
            if unknown - {"$ref"}:
                return None
        return self._validator.evolve(schema=node)


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema dict under ``node``, children before their parent (so a parent's
    rule sees its children rewritten); ``$ref`` is not followed (its target is visited where
    it lives)."""
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in list(sub.items()):
                yield from _subschemas(child, f"{pointer}/{key}/{_escape(name)}")
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in _SCHEMA_SINGLE:
        yield from _subschemas(node.get(key), f"{pointer}/{key}")
    items = node.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield from _subschemas(child, f"{pointer}/items/{i}")
    else:
        yield from _subschemas(items, f"{pointer}/items")
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, child in deps.items():
            yield from _subschemas(child, f"{pointer}/dependencies/{_escape(name)}")
    yield pointer, node


def _uses(node: Any, keys: frozenset[str]) -> bool:
    """Whether any dict anywhere in ``node`` has one of ``keys``."""
    if isinstance(node, dict):
        return bool(keys & set(node)) or any(_uses(v, keys) for v in node.values())
    if isinstance(node, list):
        return any(_uses(v, keys) for v in node)
    return False


def _local_refs(root: Any) -> list[tuple[str, str]]:
    """Every ``$ref`` of the document: ``(its pointer, its target as a JSON pointer)``. A
    reference that is not a local JSON pointer (an anchor, another document) counts as
    pointing at the root, which makes every rule that removes a subtree skip it."""
    out: list[tuple[str, str]] = []

    def visit(node: Any, pointer: str) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                local = ref == "#" or ref.startswith("#/")
                out.append((pointer, unquote(ref[1:]) if local else ""))
            for k, v in node.items():
                visit(v, f"{pointer}/{_escape(str(k))}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                visit(v, f"{pointer}/{i}")

    visit(root, "")
    return out


def _with_ref_targets(ctx: _Context) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`_subschemas` of the root, then of every ``$ref`` target the walk did not reach
    (subschemas kept under keys that are no keywords, e.g. ``{"units": {...}}``)."""
    seen: set[str] = set()
    walked = list(_subschemas(ctx.root, ""))
    seen.update(p for p, _ in walked)
    yield from walked
    for _, target in ctx.refs:
        if not target or target in seen:
            continue
        found = resolve_local_ref(ctx.root, "#" + target)
        if found is None or not isinstance(found[1], dict):
            continue
        more = [(p, n) for p, n in _subschemas(found[1], found[0]) if p not in seen]
        seen.update(p for p, _ in more)
        yield from more


def _removable(ctx: _Context, pointer: str, node: dict[str, Any], keys: list[str]) -> bool:
    """Whether ``node``'s ``keys`` may be removed: no ``$ref`` points into them and they hold
    no ``$id``/anchor (which would change how references resolve)."""
    inside = tuple(f"{pointer}/{_escape(key)}" for key in keys if key in node)
    for key in keys:
        if key not in node:
            continue
        if ctx.referenced_under(f"{pointer}/{_escape(key)}", inside=inside) or _uses(
                node[key], frozenset(_ID_KEYS)):
            return False
    return True


def _only(node: Any, *keys: str) -> bool:
    """Whether ``node`` is a dict whose assertion keywords are exactly ``keys``."""
    return isinstance(node, dict) and (set(node) & ASSERTIONS) == set(keys)


# ---------------------------------------------------------------------------------------------
# Rules (each: (ctx, pointer, node, done) -> None; rewrites ``node`` in place)
# ---------------------------------------------------------------------------------------------


def _format(ctx: _Context, pointer: str, node: dict[str, Any], done: list[Rewrite]) -> None:
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in KEPT_FORMATS:
        del node["format"]
        done.append(Rewrite(pointer, "format",
                            f"format {fmt!r} is known to no backend: an annotation, dropped"))


def _lone_condition(ctx: _Context, pointer: str, node: dict[str, Any],
                    done: list[Rewrite]) -> None:
    has_if, branches = "if" in node, [k for k in ("then", "else") if k in node]
    if has_if == bool(branches):  # a whole if/then/else (or none): left as it is
        return
    keys = ["if"] if has_if else branches
    if not _removable(ctx, pointer, node, keys):
        return
    for key in keys:
        del node[key]
    done.append(Rewrite(pointer, "lone-if", f"{'/'.join(keys)} without "
                        f"{'then/else' if has_if else 'if'} has no effect: dropped"))


def _not_not(ctx: _Context, pointer: str, node: dict[str, Any], done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (_only(inner, "not") and _removable(ctx, pointer, node, ["not"])):
        return
    assert isinstance(inner, dict)
    _add_all_of(node, inner["not"])
    del node["not"]
    done.append(Rewrite(pointer, "not-not", "'not' of 'not' S became allOf [S]"))


def _type_set(types: Any) -> set[str] | None:
    """The instance types of a ``type`` value (numbers split), or None when malformed."""
    names = [types] if isinstance(types, str) else types
    if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
        return None
    out: set[str] = set()
    for t in names:
        if t == "number":
            out |= {"integer", "fraction"}
        elif t in _TYPES and t != "fraction":
            out.add(t)
        else:
            return None
    return out


def _type_value(types: set[str]) -> list[str] | None:
    """A ``type`` list for an instance-type set, or None when it has non-integer numbers
    without the integers (no ``type`` says that)."""
    if "fraction" in types and "integer" not in types:
        return None
    out = [t for t in _TYPES if t in types and t not in ("integer", "fraction")]
    if "fraction" in types:
        out.append("number")
    elif "integer" in types:
        out.append("integer")
    return out


def _not_type(ctx: _Context, pointer: str, node: dict[str, Any], done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (_only(inner, "type") and _removable(ctx, pointer, node, ["not"])):
        return
    assert isinstance(inner, dict)
    excluded = _type_set(inner["type"])
    allowed = _type_set(node["type"]) if "type" in node else set(_TYPES)
    if excluded is None or allowed is None:
        return
    kept = _type_value(allowed - excluded)
    if not kept:  # nothing left (unsatisfiable: the compile says so) or inexpressible
        return
    node["type"] = kept[0] if len(kept) == 1 else kept
    del node["not"]
    done.append(Rewrite(pointer, "not-type", f"'not' of type {inner['type']!r} became type "
                                             f"{node['type']!r}"))


def _not_required(ctx: _Context, pointer: str, node: dict[str, Any],
                  done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (_only(inner, "required") or _only(inner, "required", "type")):
        return
    assert isinstance(inner, dict)
    names = inner["required"]
    if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str)):
        return
    if "type" in inner and _type_set(inner["type"]) != {"object"}:
        return
    name = names[0]
    allowed = _type_set(node["type"]) if "type" in node else set(_TYPES)
    required = node.get("required")
    props = node.get("properties", {})
    # not {required: [p]} fails every non-object (required ignores them) and every object
    # with p: the instance is an object without p
    if (allowed is None or "object" not in allowed
            or (isinstance(required, list) and name in required)
            or not isinstance(props, dict)
            or not _removable(ctx, pointer, node, ["not"])
            or (name in props and not _removable(ctx, f"{pointer}/properties", props, [name]))):
        return
    node["type"] = "object"
    node["properties"] = {**props, name: False}
    del node["not"]
    done.append(Rewrite(pointer, "not-required",
                        f"'not' of required [{name!r}] became properties.{name}: false"))


def _not_property_names(ctx: _Context, pointer: str, node: dict[str, Any],
                        done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not _only(inner, "propertyNames"):
        return
    assert isinstance(inner, dict)
    names = inner["propertyNames"]
    excluded = names.get("not") if _only(names, "not") else None
    values = _finite_values(excluded) if _only(excluded, "const") or _only(excluded,
                                                                            "enum") else None
    if not (values and len(values) == 1 and isinstance(values[0], str)):
        return
    name = values[0]
    allowed = _type_set(node["type"]) if "type" in node else set(_TYPES)
    required = node.get("required", [])
    if (allowed is None or "object" not in allowed or not isinstance(required, list)
            or not _removable(ctx, pointer, node, ["not"])):
        return
    # propertyNames ignores non-objects (so its 'not' fails them); on an object, "not every
    # name differs from c" is "some name is c"
    node["type"] = "object"
    if name not in required:
        node["required"] = [*required, name]
    del node["not"]
    done.append(Rewrite(pointer, "not-propertyNames",
                        f"'not' of propertyNames 'not' {name!r} became required [{name!r}]"))


def _one_of(ctx: _Context, pointer: str, node: dict[str, Any], done: list[Rewrite]) -> None:
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches or "anyOf" in node:
        return
    if len(branches) > 1 and not _pairwise_disjoint(ctx, branches):
        return
    if ctx.referenced_under(f"{pointer}/oneOf"):
        return  # the branches move to anyOf: a $ref into them would dangle
    node["anyOf"] = node.pop("oneOf")
    done.append(Rewrite(pointer, "oneOf-disjoint",
                        "'oneOf' with one branch or pairwise disjoint branches became 'anyOf'"))


def _pairwise_disjoint(ctx: _Context, branches: list[Any]) -> bool:
    """Whether no instance matches two of ``branches`` (then ``oneOf`` == ``anyOf``)."""
    if _disjoint_by_check(branches, ctx.root):
        return True
    for a, b in itertools.combinations(branches, 2):
        if not (_disjoint_by_check([a, b], ctx.root) or _finite_excluded(ctx, a, b)
                or _finite_excluded(ctx, b, a)):
            return False
    return True


def _finite_excluded(ctx: _Context, a: Any, b: Any) -> bool:
    """Whether ``a`` accepts finitely many values (``enum``/``const``) and ``b`` none of
    them (checked with ``jsonschema``)."""
    values = _finite_values(_deref(ctx, a))
    if values is None:
        return False
    validator = ctx.validator(b)
    if validator is None:
        return False
    try:
        return not any(validator.is_valid(v) for v in values)
    except PatternTimeLimit:  # a pattern too slow to decide: not proven disjoint
        return False


def _deref(ctx: _Context, node: Any) -> Any:
    for _ in range(16):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)
                and len(set(node) & ASSERTIONS) == 1):
            return node
        target = resolve_local_ref(ctx.root, node["$ref"])
        if target is None:
            return node
        node = target[1]
    return node


def _finite_values(node: Any) -> list[Any] | None:
    """The values a subschema's own ``enum``/``const`` allows (before its other keywords),
    or None when it has neither."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    return None


def _enum_filter(ctx: _Context, pointer: str, node: dict[str, Any],
                 done: list[Rewrite]) -> None:
    candidates = _finite_values(node)
    if candidates is None:
        for branch in node.get("allOf") or []:
            candidates = _finite_values(_deref(ctx, branch))
            if candidates is not None:
                break
    if candidates is None or len(candidates) > MAX_ENUM_VALUES:
        return
    others = (set(node) & ASSERTIONS) - {"enum"}
    if not others:
        return  # a plain enum: both backends enforce it as it is
    if "const" in node and others == {"const"}:
        return
    removed = sorted(set(node) & ASSERTIONS)
    # jsonschema checks no ``format`` (an annotation to it), the backends enforce the ones
    # they know: keep such nodes as they are
    if not _removable(ctx, pointer, node, removed) or _uses(
            {k: node[k] for k in removed}, frozenset({"format"})):
        return
    validator = ctx.validator(node)
    if validator is None:
        return
    try:
        kept = [v for v in candidates if validator.is_valid(v)]
    except Exception:  # noqa: BLE001 - a malformed subschema: the compile reports it
        return
    if others <= {"type", "const"} and len(kept) == len(candidates):
        return  # every listed value has the listed type: both backends serve it as it is
    for key in removed:
        del node[key]
    node["enum"] = kept
    done.append(Rewrite(pointer, "enum-filter",
                        f"{len(kept)} of {len(candidates)} listed values satisfy "
                        f"{', '.join(repr(k) for k in removed)}: became an enum"))


def _dependencies(ctx: _Context, pointer: str, node: dict[str, Any],
                  done: list[Rewrite]) -> None:
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = node.get(key)
        if not isinstance(deps, dict) or not _removable(ctx, pointer, node, [key]):
            continue
        if not all(_dependency_ok(key, v) for v in deps.values()):
            continue
        required = node.get("required")
        if required is not None and not isinstance(required, list):
            continue
        for name, dep in deps.items():
            _add_dependency(node, name, dep)
        del node[key]
        done.append(Rewrite(pointer, key, f"'{key}' on {sorted(deps)} became required / "
                                          "anyOf [property absent, dependency met]"))


def _dependency_ok(key: str, dep: Any) -> bool:
    if key == "dependentRequired" or (key == "dependencies" and isinstance(dep, list)):
        return isinstance(dep, list) and all(isinstance(d, str) for d in dep)
    return isinstance(dep, (dict, bool))


def _add_dependency(node: dict[str, Any], name: str, dep: Any) -> None:
    """Add ``name``'s dependency (a list of names or a schema) to ``node`` (see the module
    docstring's table)."""
    required = node.get("required") or []
    if isinstance(dep, list):
        if name in required:
            node["required"] = required + [d for d in dep if d not in required]
        elif dep:
            _add_all_of(node, {"anyOf": [{"properties": {name: False}},
                                         {"required": [name, *dep]}]})
        return
    if dep is True:
        return
    if name in required:
        _add_all_of(node, dep)
    elif dep is False:
        _add_all_of(node, {"properties": {name: False}})
    else:
        _add_all_of(node, {"anyOf": [{"properties": {name: False}},
                                     {"allOf": [{"required": [name]}, dep]}]})


def _add_all_of(node: dict[str, Any], schema: Any) -> None:
    """Append ``schema`` to ``node``'s ``allOf`` (created when absent; existing branches keep
    their pointers)."""
    node["allOf"] = [*node.get("allOf", []), schema]


_RULES: tuple[Callable[[_Context, str, dict[str, Any], list[Rewrite]], None], ...] = (
    _format, _lone_condition, _not_not, _not_type, _not_required, _not_property_names,
    _dependencies, _one_of, _enum_filter)
"""In order: the ``not`` rules run before the ``enum`` filter, which would otherwise take
nodes they rewrite into plain keywords."""
