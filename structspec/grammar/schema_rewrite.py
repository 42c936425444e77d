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
``oneOf`` -> ``anyOf``      when the branches are pairwise disjoint, or there is one branch.
                            Two branches are disjoint when one accepts finitely many values
                            (``enum``, ``const``, or a string ``pattern`` ``^literal$``: the
                            literal, and it with a final newline, which Python's ``$`` allows)
                            none of which the other accepts (checked with ``jsonschema``); when
                            no type the node's own ``type`` allows is common to both; or when
                            objects are the only common type and one requires a name the other
                            forbids (``properties.p: false``, or ``additionalProperties: false``
                            without ``p`` and without ``patternProperties``) or both require a
                            property whose subschemas are disjoint (recursively; a
                            ``const``/``enum`` discriminator among them). The property proofs
                            need objects only: ``{"required": ["k"]}`` accepts ``5``. Closed
                            object branches of one property each, several of which accept
                            ``{}``, overlap only on ``{}``, which ``oneOf`` therefore rejects:
                            each gets ``required`` its property
``oneOf`` of ``required``   ``oneOf [{required: R1}, ..., {required: Rn}]`` (n >= 2): an object
                            with all of some ``Ri`` and, for each other ``j``, without some name
                            of ``Rj`` (``properties.q: false``); ``anyOf`` over ``i`` and those
                            choices, each branch ``type`` object unless the node is (a
                            non-object matches every branch, so ``oneOf`` rejects it)
``allOf`` merge             the node's own keywords and its ``allOf`` branches (``$ref`` ones
                            inlined, nested ``allOf`` flattened) become one schema when each
                            uses only ``type`` (intersected), ``properties`` (a name in several
                            parts gets their merge), ``required`` (united),
                            ``additionalProperties`` ``true``/``false`` (a closed part allows
                            only its names: the merge keeps the names every closed part lists,
                            closed), annotations (dropped) and keywords that constrain the
                            instance alone (``minLength``, ``pattern``, ``enum``, ``maximum``...;
                            each in one part only; no ``format`` beside ``enum``/``const``:
                            the strict check validates the values with ``jsonschema``, which
                            asserts no format). Without a closed part a ``required`` name no
                            part lists gets ``properties.p: {}``
``minProperties: 1``        beside optional properties (llguidance takes ``min/maxProperties``
                            only when every listed property is required; xgrammar takes it as
                            it is, so this runs only for a schema xgrammar refuses anyway): with
                            a ``required`` name it is implied, dropped; else ``anyOf`` [one
                            branch ``required [p]`` per listed ``p``, ``{properties: {p: false,
                            ...}, minProperties: 1}``] (the last left out when the node is
                            closed): a non-empty object has a listed name or an other one
``dependencies``,           ``{a: [b, ...]}``: ``b, ...`` added to ``required`` when ``a`` is
``dependentRequired``,      required, else ``anyOf [{properties: {a: false}},
``dependentSchemas``        {required: [a, b, ...]}]`` appended to ``allOf``; ``{a: S}``: ``S``
                            appended to ``allOf`` when ``a`` is required, else ``anyOf
                            [{properties: {a: false}}, {allOf: [{required: [a]}, S]}]``
==========================  ================================================================

Rewrites that remove a subtree are skipped when a ``$ref`` points into it, or when the
schema uses ``unevaluatedProperties``/``unevaluatedItems`` (their result depends on which
subschemas evaluated a property, which the rewrites change) or dynamic references. The
``allOf`` merge runs after the other rules (it copies ``$ref`` targets, which are rewritten by
then) and is skipped when a ``$ref`` points into the node's keywords, when the node has a
``$ref`` (draft-07 and earlier ignore the keywords beside it) or when a subschema below the
root has an ``$id``/``id``/anchor (a copied reference could resolve from another base). The
``enum`` filter skips a node with keywords beside its ``$ref`` for the same reason (its values
would replace the ``$ref``).

Not rewritten: ``oneOf`` branches that may overlap, ``uniqueItems``, ``contains``, ``not`` of
a ``pattern`` or an ``anyOf`` (no exact form either backend enforces), and a whole
``if``/``then``/``else``: the one MaskBench schema with one
(``mongodb-atlas-search-index-definition``, ``if: {properties: {type: {const: ...}}}``) also
has a lookahead ``pattern`` neither backend takes, so a rule would serve nothing more.
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
from structspec.grammar.schema_check import (
    ASSERTIONS,
    KNOWN_FORMATS,
    UNENFORCED_FORMATS,
    _types_of,
    find_unenforceable,
)
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
            ``not-required``, ``not-propertyNames``, ``oneOf-disjoint``, ``oneOf-required``,
            ``dependencies``, ``dependentRequired``, ``dependentSchemas``, ``lone-if``,
            ``allOf-merge``, ``minProperties``).
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
    # the allOf merge copies $ref targets: after the other rules, so the copies are rewritten
    ctx.refs = _local_refs(root)
    for pointer, node in list(_with_ref_targets(ctx)):
        _all_of_merge(ctx, pointer, node, done)
    # forms only llguidance takes, for what xgrammar enforces as it is: only when xgrammar's
    # strict check refuses the schema anyway (else they would move it off xgrammar)
    candidates = [(p, n) for p, n in _with_ref_targets(ctx) if _min_properties_form(n)]
    if candidates and find_unenforceable(root):
        for pointer, node in candidates:
            _min_properties(ctx, pointer, node, done)
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
        self._nested_ids: bool | None = None

    def nested_ids(self) -> bool:
        """Whether a subschema below the root sets a base URI or an anchor (then a local
        ``$ref`` under it may not mean the root's pointer: the ``allOf`` merge, which copies
        references elsewhere, leaves such documents alone)."""
        if self._nested_ids is None:
            self._nested_ids = any(
                isinstance(sub.get(k), str) for pointer, sub in _subschemas(self.root, "")
                if pointer for k in (*_ID_KEYS, "id"))
        return self._nested_ids

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
    # the instances the branches are told apart on: those of the node's own type
    within = (_type_set(node["type"]) if "type" in node else None) or set(_TYPES)
    detail = "'oneOf' with one branch or pairwise disjoint branches became 'anyOf'"
    if len(branches) > 1 and not _pairwise_disjoint(ctx, branches, within):
        fixed = _without_empty_overlap(ctx, branches)
        if fixed is None or not _pairwise_disjoint(ctx, fixed, within):
            return
        branches = fixed
        detail = ("'oneOf' of closed one-property branches became 'anyOf', each branch "
                  "accepting {} requiring its property")
    if ctx.referenced_under(f"{pointer}/oneOf"):
        return  # the branches move to anyOf: a $ref into them would dangle
    del node["oneOf"]
    node["anyOf"] = branches
    done.append(Rewrite(pointer, "oneOf-disjoint", detail))


_DISJOINT_DEPTH = 4
"""Property levels the disjointness proof descends (a discriminator inside a required
object property, e.g. ``to.reachable``)."""


def _pairwise_disjoint(ctx: _Context, branches: list[Any], within: set[str]) -> bool:
    """Whether no instance of the ``within`` types matches two of ``branches`` (then
    ``oneOf`` == ``anyOf`` in a node whose ``type`` allows only those)."""
    targets = [_target(ctx, b) for b in branches]
    if (all(isinstance(t, dict) and _possible_types(ctx, t) & within <= {"object"}
            for t in targets) and _disjoint_by_check(targets, ctx.root)):
        return True  # objects only, told apart by one discriminator property (linear time)
    return all(_disjoint(ctx, a, b, within) for a, b in itertools.combinations(branches, 2))


def _disjoint(ctx: _Context, a: Any, b: Any, within: set[str], depth: int = 0) -> bool:
    """Whether no instance of the ``within`` types matches both ``a`` and ``b`` (the module
    docstring's proofs; False when none applies). ``$ref`` is followed whatever its siblings:
    a schema with a ``$ref`` accepts at most what the target accepts, in every draft."""
    if _finite_excluded(ctx, a, b) or _finite_excluded(ctx, b, a):
        return True
    a, b = _target(ctx, a), _target(ctx, b)
    if not (isinstance(a, dict) and isinstance(b, dict)) or depth > _DISJOINT_DEPTH:
        return False
    common = _possible_types(ctx, a) & _possible_types(ctx, b) & within
    if common != {"object"}:
        # the property proofs hold for objects only: required and properties accept every
        # other instance ({"required": ["k"]} and {"properties": {"k": ...}} both accept 5)
        return not common
    if _disjoint_by_check([a, b], ctx.root):  # a discriminator property both require
        return True
    required_a, required_b = _required_names(a), _required_names(b)
    if any(_forbids(b, n) for n in required_a) or any(_forbids(a, n) for n in required_b):
        return True
    props_a, props_b = a.get("properties"), b.get("properties")
    if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
        return False
    # a property both require: its value must match both subschemas
    return any(n in props_a and n in props_b
               and _disjoint(ctx, props_a[n], props_b[n], set(_TYPES), depth + 1)
               for n in sorted(required_a & required_b))


def _target(ctx: _Context, node: Any) -> Any:
    """``node`` with its ``$ref`` chain followed (None for a reference that does not resolve
    here: in draft-07 and earlier the keywords beside it mean nothing)."""
    for _ in range(16):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
            return node
        found = resolve_local_ref(ctx.root, node["$ref"])
        if found is None:
            return None
        node = found[1]
    return None


def _possible_types(ctx: _Context, node: dict[str, Any]) -> set[str]:
    """The instance types (:data:`_TYPES`) ``node`` may accept (all when unknown)."""
    found = _types_of(node, ctx.root)
    if found is None:
        return set(_TYPES)
    out: set[str] = set()
    for t in found:
        out |= {"integer", "fraction"} if t == "number" else ({t} & set(_TYPES))
    return out


def _required_names(node: dict[str, Any]) -> set[str]:
    required = node.get("required")
    return {n for n in required if isinstance(n, str)} if isinstance(required, list) else set()


def _forbids(node: dict[str, Any], name: str) -> bool:
    """Whether ``node`` rejects every object that has the property ``name``."""
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    if name in props:
        return props[name] is False
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def _without_empty_overlap(ctx: _Context, branches: list[Any]) -> list[Any] | None:
    """``branches`` with ``required: [p]`` added to each branch that accepts ``{}``, when at
    least two do and each of those is a closed object schema of the one property ``p``
    (``additionalProperties: false``, no ``patternProperties``); else None. Exact inside
    ``oneOf``: ``{}`` matches two branches, so ``oneOf`` rejects it, as every changed branch
    now does; on any other instance a changed branch decides as before (a non-empty object
    it accepts has ``p``; ``required`` ignores non-objects)."""
    accepting = []
    for i, branch in enumerate(branches):
        validator = ctx.validator(branch)
        if validator is None:
            return None
        try:
            if validator.is_valid({}):
                accepting.append(i)
        except Exception:  # noqa: BLE001 - a malformed branch or a slow pattern: not proven
            return None
    if len(accepting) < 2:
        return None
    out = list(branches)
    for i in accepting:
        branch = branches[i]
        if not (isinstance(branch, dict) and branch.get("additionalProperties") is False
                and isinstance(branch.get("properties"), dict)
                and len(branch["properties"]) == 1 and not branch.get("patternProperties")
                and "$ref" not in branch and not branch.get("required")):
            return None
        out[i] = {**branch, "required": list(branch["properties"])}
    return out


def _finite_excluded(ctx: _Context, a: Any, b: Any) -> bool:
    """Whether ``a`` accepts finitely many values (``enum``/``const``, or a string ``pattern``
    ``^literal$``) and ``b`` none of them (checked with ``jsonschema``)."""
    a = _deref(ctx, a)
    values = _finite_values(a)
    if values is None:
        values = _literal_pattern_values(a)
    if values is None:
        return False
    validator = ctx.validator(b)
    if validator is None:
        return False
    try:
        return not any(validator.is_valid(v) for v in values)
    except PatternTimeLimit:  # a pattern too slow to decide: not proven disjoint
        return False


_REGEX_SYNTAX = frozenset("\\.^$*+?()[]{}|")


def _literal_pattern_values(node: Any) -> list[str] | None:
    """The strings a ``{"type": "string", "pattern": "^literal$"}`` node accepts (the literal
    without regex syntax): the literal, and the literal with a final newline (Python's ``$``
    matches before one; ECMA-262's does not: a superset either way), or None."""
    if not (isinstance(node, dict) and node.get("type") in ("string", ["string"])):
        return None
    pattern = node.get("pattern")
    if not (isinstance(pattern, str) and len(pattern) > 2 and pattern[0] == "^"
            and pattern[-1] == "$" and not _REGEX_SYNTAX & set(pattern[1:-1])):
        return None
    return [pattern[1:-1], pattern[1:-1] + "\n"]


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
    if "$ref" in node and len(set(node) & ASSERTIONS) > 1:
        return  # draft-07 and earlier ignore the keywords beside $ref, later drafts do not
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


MAX_EXCLUSIVE_BRANCHES = 64
"""Most ``anyOf`` branches the ``oneOf`` of ``required`` rule writes (their number is a
product of the other branches' name counts)."""


def _one_of_required(ctx: _Context, pointer: str, node: dict[str, Any],
                     done: list[Rewrite]) -> None:
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2 or "anyOf" in node:
        return
    sets: list[list[str]] = []
    for branch in branches:
        names = branch.get("required") if _only(branch, "required") else None
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            return
        sets.append(list(dict.fromkeys(names)))
    allowed = _type_set(node["type"]) if "type" in node else set(_TYPES)
    if allowed is None or ctx.referenced_under(f"{pointer}/oneOf"):
        return
    out: list[dict[str, Any]] = []
    for i, own in enumerate(sets):
        # every other branch must fail: some name of it that this one does not require is
        # absent (one that is a subset of this one always matches too: no branch)
        missing = [[n for n in other if n not in own] for j, other in enumerate(sets) if j != i]
        if not all(missing):
            continue
        for absent in _minimal_choices(missing):
            branch: dict[str, Any] = {} if allowed == {"object"} else {"type": "object"}
            branch["required"] = own
            branch["properties"] = {n: False for n in absent}
            out.append(branch)
            if len(out) > MAX_EXCLUSIVE_BRANCHES:
                return
    if not out:
        return  # no object matches exactly one branch: left to the backends
    del node["oneOf"]
    node["anyOf"] = out
    done.append(Rewrite(pointer, "oneOf-required",
                        f"'oneOf' of {len(sets)} 'required' lists became 'anyOf' of {len(out)} "
                        "branches, each with the names of one list and without one name of "
                        "each other list"))


def _minimal_choices(groups: list[list[str]]) -> list[list[str]]:
    """One name from each group, every way (as sorted name lists), leaving out a choice that
    contains another one (it adds no instance to the ``anyOf``)."""
    choices = sorted({frozenset(c) for c in itertools.product(*groups)}, key=len)
    kept: list[frozenset[str]] = []
    for c in choices:
        if not any(k <= c for k in kept):
            kept.append(c)
    return [sorted(c) for c in kept]


# ---------------------------------------------------------------------------------------------
# allOf merge (a second pass: after the other rules, whose rewrites the merge copies)
# ---------------------------------------------------------------------------------------------

_INDEPENDENT = frozenset({
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "multipleOf", "enum",
    "const", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties"})
"""Keywords whose verdict depends on the instance alone, not on other keywords of their
schema (unlike ``additionalProperties``, ``additionalItems``, draft-04's boolean
``exclusiveMaximum``...): one of them moves to a merged schema unchanged."""

_MERGED_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "allOf"})

MAX_MERGE_DEPTH = 8
"""Nested ``$ref`` / ``allOf`` / property levels an ``allOf`` merge follows."""

MAX_MERGED_CHARS = 200_000
"""Largest merged schema (JSON characters) the merge writes (it copies ``$ref`` targets)."""


class _NotMergeable(Exception):
    """A part of an ``allOf`` merge uses a keyword (or a form) the merge does not combine."""


def _all_of_merge(ctx: _Context, pointer: str, node: dict[str, Any],
                  done: list[Rewrite]) -> None:
    branches = node.get("allOf")
    if not isinstance(branches, list) or not branches:
        return
    own = {k: v for k, v in node.items() if k in ASSERTIONS and k != "allOf"}
    if (len(branches) == 1 and not own) or "$ref" in own:
        # a single branch alone: both backends take it as it is; beside a $ref, draft-07 and
        # earlier ignore the allOf (2019-09 and later do not)
        return
    keys = [k for k in node if k in ASSERTIONS]
    if ctx.nested_ids() or any(ctx.referenced_under(f"{pointer}/{_escape(k)}") for k in keys):
        return
    try:
        merged = _merge(ctx, [own, *branches], 0)
    except _NotMergeable:
        return
    if len(json.dumps(merged)) > MAX_MERGED_CHARS:
        return
    for key in keys:
        del node[key]
    # the copies' references point where references of the document already point (the
    # originals stay in place), so ctx.refs still lists every target
    node.update(merged)
    done.append(Rewrite(pointer, "allOf-merge",
                        f"'allOf' of {len(branches)} branches merged into one schema"))


def _merge(ctx: _Context, parts: list[Any], depth: int) -> dict[str, Any]:
    """The one schema that accepts exactly what every part accepts (module docstring).

    Raises:
        _NotMergeable: a part the merge cannot combine exactly.
    """
    flat: list[dict[str, Any]] = []
    for part in parts:
        _flatten(ctx, part, depth, flat)
    out: dict[str, Any] = {}
    types: set[str] | None = None
    for part in flat:
        if "type" in part:
            found = _type_set(part["type"])
            if found is None:
                raise _NotMergeable
            types = found if types is None else types & found
    if types is not None:
        value = _type_value(types)
        if not value:
            raise _NotMergeable  # unsatisfiable or inexpressible: left to the backends
        out["type"] = value[0] if len(value) == 1 else value
    required: list[str] = []
    props: dict[str, list[Any]] = {}
    closed: list[set[str]] = []
    for part in flat:
        names = part.get("required", [])
        part_props = part.get("properties", {})
        extra = part.get("additionalProperties", True)
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)
                and isinstance(part_props, dict)
                and (extra is True or extra is False or extra == {})):
            raise _NotMergeable
        required += [n for n in names if n not in required]
        for name, sub in part_props.items():
            props.setdefault(name, []).append(sub)
        if extra is False:
            closed.append(set(part_props))
    if closed:  # a name some closed part does not list is forbidden: left out, closed
        allowed = set.intersection(*closed)
        if any(n not in allowed for n in required):
            raise _NotMergeable  # no object is valid: left to the backends
        props = {n: subs for n, subs in props.items() if n in allowed}
    else:  # the strict check wants each required name listed; {} changes nothing
        for name in required:
            props.setdefault(name, [{}])
    if props:
        out["properties"] = {n: _merge_property(ctx, subs, depth) for n, subs in props.items()}
    if required:
        out["required"] = required
    if closed:
        out["additionalProperties"] = False
    for part in flat:
        for key in set(part) & _INDEPENDENT:
            if key in out:
                raise _NotMergeable  # the same keyword twice: not combined
            out[key] = copy.deepcopy(part[key])
    if "format" in out and ("enum" in out or "const" in out):
        # the strict check tells whether xgrammar may keep just the values by validating them
        # against their siblings with jsonschema, which asserts no format
        raise _NotMergeable
    return out


def _flatten(ctx: _Context, part: Any, depth: int, flat: list[dict[str, Any]]) -> None:
    """Append ``part``'s conjuncts to ``flat``: ``$ref`` targets and ``allOf`` branches in
    place of the references and the ``allOf``; parts with no assertion left out (they accept
    everything).

    Raises:
        _NotMergeable: as :func:`_merge`.
    """
    if depth > MAX_MERGE_DEPTH or part is False or not isinstance(part, (dict, bool)):
        raise _NotMergeable
    if part is True:
        return
    keys = set(part) & ASSERTIONS
    if "$ref" in keys:
        found = resolve_local_ref(ctx.root, part["$ref"]) if keys == {"$ref"} else None
        if found is None or _has_ids(found[1]):
            raise _NotMergeable  # $ref beside keywords: what they mean depends on the draft
        _flatten(ctx, found[1], depth + 1, flat)
        return
    if keys - _MERGED_KEYS - _INDEPENDENT:
        raise _NotMergeable
    if _has_ids(part):
        raise _NotMergeable
    branches = part.get("allOf", [])
    if not isinstance(branches, list):
        raise _NotMergeable
    for branch in branches:
        _flatten(ctx, branch, depth + 1, flat)
    if keys - {"allOf"}:
        flat.append(part)


def _merge_property(ctx: _Context, subs: list[Any], depth: int) -> Any:
    """One property's subschemas from the merged parts, as one schema: the one that
    constrains (a copy), or their merge."""
    kept = [s for s in subs if not (s is True or (isinstance(s, dict)
                                                  and not set(s) & ASSERTIONS))]
    if not kept:
        return copy.deepcopy(subs[0]) if isinstance(subs[0], dict) else {}
    if len(kept) == 1:
        if _has_ids(kept[0]):
            raise _NotMergeable
        return copy.deepcopy(kept[0])
    return _merge(ctx, kept, depth + 1)


def _has_ids(node: Any) -> bool:
    """Whether a subschema under ``node`` sets a base URI or an anchor (a copy of it would
    resolve references differently)."""
    return any(isinstance(sub.get(k), str) for _, sub in _subschemas(node, "")
               for k in (*_ID_KEYS, "id"))


# ---------------------------------------------------------------------------------------------
# minProperties (a third pass, only for a schema xgrammar refuses anyway)
# ---------------------------------------------------------------------------------------------


def _min_properties_form(node: dict[str, Any]) -> bool:
    """Whether ``node`` has ``minProperties: 1`` beside a listed property it does not
    require (which llguidance refuses)."""
    value = node.get("minProperties")
    props = node.get("properties")
    if isinstance(value, bool) or value != 1 or not isinstance(props, dict) or not props:
        return False
    required = node.get("required")
    return not (isinstance(required, list) and set(props) <= set(required))


def _min_properties(ctx: _Context, pointer: str, node: dict[str, Any],
                    done: list[Rewrite]) -> None:
    required = node.get("required")
    if required is not None and not isinstance(required, list):
        return
    if required and any(isinstance(n, str) for n in required):
        # an object with a required property has one: minProperties 1 adds nothing
        del node["minProperties"]
        done.append(Rewrite(pointer, "minProperties",
                            "'minProperties': 1 beside 'required' names is implied: dropped"))
        return
    names = list(node["properties"])
    # a non-empty object has a listed property, or none of them and another one
    branches: list[Any] = [{"required": [n]} for n in names]
    if not (node.get("additionalProperties") is False and not node.get("patternProperties")):
        branches.append({"properties": {n: False for n in names}, "minProperties": 1})
    del node["minProperties"]
    if "anyOf" in node:
        _add_all_of(node, {"anyOf": branches})
    else:
        node["anyOf"] = branches
    done.append(Rewrite(pointer, "minProperties",
                        f"'minProperties': 1 beside optional properties became anyOf "
                        f"[required one of {len(names)} names, none of them and another]"))


_RULES: tuple[Callable[[_Context, str, dict[str, Any], list[Rewrite]], None], ...] = (
    _format, _lone_condition, _not_not, _not_type, _not_required, _not_property_names,
    _dependencies, _one_of, _one_of_required, _enum_filter)
"""In order: the ``not`` rules run before the ``enum`` filter, which would otherwise take
nodes they rewrite into plain keywords."""
