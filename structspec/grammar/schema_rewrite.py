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
``$ref`` pointer            a local ``$ref`` with a percent or ``~`` escape, a character a URI
                            fragment cannot hold, or an array index (which the backends do not
                            resolve alike) points at a copy of its target under the root's
                            ``$defs`` (:mod:`~structspec.grammar.schema_rewrite_refs`; runs
                            first)
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

This module holds the public API, the walk and the simple rules (``format``, lone ``if``, the
``not`` rules, the ``enum`` filter, the dependencies); the ``oneOf`` rules are in
:mod:`~structspec.grammar.schema_rewrite_one_of`, the ``allOf`` merge and the
``minProperties`` split in :mod:`~structspec.grammar.schema_rewrite_all_of`, and what they
share (:class:`Rewrite`, the context, small helpers) in
:mod:`~structspec.grammar.schema_rewrite_context`.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

from structspec.grammar.bounded_validator import pattern_budget
from structspec.grammar.schema_check import (
    ASSERTIONS,
    KNOWN_FORMATS,
    UNENFORCED_FORMATS,
    find_unenforceable,
)
from structspec.grammar.schema_rewrite_all_of import (
    all_of_merge,
    min_properties,
    min_properties_form,
)
from structspec.grammar.schema_rewrite_context import (
    ID_KEYS,
    TYPES,
    Rewrite,
    RewriteContext,
    add_all_of,
    deref,
    finite_values,
    only,
    subschemas,
    type_set,
    type_value,
    uses,
)
from structspec.grammar.schema_rewrite_one_of import one_of_disjoint, one_of_required
from structspec.grammar.schema_rewrite_refs import ref_pointers
from structspec.schema_structure import escape_pointer_token as _escape
from structspec.schema_structure import resolve_pointer

__all__ = ["Rewrite", "rewrite_schema", "rewrite_schema_text"]

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

_NOT_REWRITTEN = frozenset({"unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
                            "$recursiveRef"})


def rewrite_schema(schema: Any) -> tuple[Any, list[Rewrite]]:
    """Rewrite the usages of the module docstring's table into exactly equivalent ones.

    Args:
        schema: a parsed JSON Schema (dict or boolean); not modified.

    Returns:
        ``(rewritten schema, rewrites applied)``; the schema is ``schema`` itself when no rule
        applied.
    """
    if not isinstance(schema, dict) or uses(schema, _NOT_REWRITTEN):
        return schema, []
    root = copy.deepcopy(schema)
    done: list[Rewrite] = []
    ctx = RewriteContext(root, _local_refs(root))
    ref_pointers(ctx, done)  # first: the rules below resolve references as the backends will
    if done:
        ctx.refs = _local_refs(root)
    for pointer, node in list(_with_ref_targets(ctx)):
        for rule in _RULES:
            rule(ctx, pointer, node, done)
    # the allOf merge copies $ref targets: after the other rules, so the copies are rewritten
    ctx.refs = _local_refs(root)
    for pointer, node in list(_with_ref_targets(ctx)):
        all_of_merge(ctx, pointer, node, done)
    # forms only llguidance takes, for what xgrammar enforces as it is: only when xgrammar's
    # strict check refuses the schema anyway (else they would move it off xgrammar)
    candidates = [(p, n) for p, n in _with_ref_targets(ctx) if min_properties_form(n)]
    if candidates and find_unenforceable(root):
        for pointer, node in candidates:
            min_properties(ctx, pointer, node, done)
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
# Walking (the subschemas themselves: schema_rewrite_context.subschemas)
# ---------------------------------------------------------------------------------------------


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


def _with_ref_targets(ctx: RewriteContext) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`subschemas` of the root, then of every ``$ref`` target the walk did not reach
    (subschemas kept under keys that are no keywords, e.g. ``{"units": {...}}``)."""
    seen: set[str] = set()
    walked = list(subschemas(ctx.root, ""))
    seen.update(p for p, _ in walked)
    yield from walked
    for _, target in ctx.refs:
        if not target or target in seen:
            continue
        found = resolve_pointer(ctx.root, target)
        if found is None or not isinstance(found[1], dict):
            continue
        more = [(p, n) for p, n in subschemas(found[1], found[0]) if p not in seen]
        seen.update(p for p, _ in more)
        yield from more


def _removable(ctx: RewriteContext, pointer: str, node: dict[str, Any],
               keys: list[str]) -> bool:
    """Whether ``node``'s ``keys`` may be removed: no ``$ref`` points into them and they hold
    no ``$id``/anchor (which would change how references resolve)."""
    inside = tuple(f"{pointer}/{_escape(key)}" for key in keys if key in node)
    for key in keys:
        if key not in node:
            continue
        if ctx.referenced_under(f"{pointer}/{_escape(key)}", inside=inside) or uses(
                node[key], frozenset(ID_KEYS)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Rules (each: (ctx, pointer, node, done) -> None; rewrites ``node`` in place); the oneOf
# rules: schema_rewrite_one_of; the allOf merge and minProperties: schema_rewrite_all_of
# ---------------------------------------------------------------------------------------------


def _format(ctx: RewriteContext, pointer: str, node: dict[str, Any],
            done: list[Rewrite]) -> None:
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in KEPT_FORMATS:
        del node["format"]
        done.append(Rewrite(pointer, "format",
                            f"format {fmt!r} is known to no backend: an annotation, dropped"))


def _lone_condition(ctx: RewriteContext, pointer: str, node: dict[str, Any],
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


def _not_not(ctx: RewriteContext, pointer: str, node: dict[str, Any],
             done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (only(inner, "not") and _removable(ctx, pointer, node, ["not"])):
        return
    assert isinstance(inner, dict)
    add_all_of(node, inner["not"])
    del node["not"]
    done.append(Rewrite(pointer, "not-not", "'not' of 'not' S became allOf [S]"))


def _not_type(ctx: RewriteContext, pointer: str, node: dict[str, Any],
              done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (only(inner, "type") and _removable(ctx, pointer, node, ["not"])):
        return
    assert isinstance(inner, dict)
    excluded = type_set(inner["type"])
    allowed = type_set(node["type"]) if "type" in node else set(TYPES)
    if excluded is None or allowed is None:
        return
    kept = type_value(allowed - excluded)
    if not kept:  # nothing left (unsatisfiable: the compile says so) or inexpressible
        return
    node["type"] = kept[0] if len(kept) == 1 else kept
    del node["not"]
    done.append(Rewrite(pointer, "not-type", f"'not' of type {inner['type']!r} became type "
                                             f"{node['type']!r}"))


def _not_required(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                  done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not (only(inner, "required") or only(inner, "required", "type")):
        return
    assert isinstance(inner, dict)
    names = inner["required"]
    if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str)):
        return
    if "type" in inner and type_set(inner["type"]) != {"object"}:
        return
    name = names[0]
    allowed = type_set(node["type"]) if "type" in node else set(TYPES)
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


def _not_property_names(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                        done: list[Rewrite]) -> None:
    inner = node.get("not")
    if not only(inner, "propertyNames"):
        return
    assert isinstance(inner, dict)
    names = inner["propertyNames"]
    excluded = names.get("not") if only(names, "not") else None
    values = (finite_values(excluded) if only(excluded, "const") or only(excluded, "enum")
              else None)
    if not (values and len(values) == 1 and isinstance(values[0], str)):
        return
    name = values[0]
    allowed = type_set(node["type"]) if "type" in node else set(TYPES)
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


def _enum_filter(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                 done: list[Rewrite]) -> None:
    if "$ref" in node and len(set(node) & ASSERTIONS) > 1:
        return  # draft-07 and earlier ignore the keywords beside $ref, later drafts do not
    candidates = finite_values(node)
    if candidates is None:
        for branch in node.get("allOf") or []:
            candidates = finite_values(deref(ctx, branch))
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
    if not _removable(ctx, pointer, node, removed) or uses(
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


def _dependencies(ctx: RewriteContext, pointer: str, node: dict[str, Any],
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
            add_all_of(node, {"anyOf": [{"properties": {name: False}},
                                        {"required": [name, *dep]}]})
        return
    if dep is True:
        return
    if name in required:
        add_all_of(node, dep)
    elif dep is False:
        add_all_of(node, {"properties": {name: False}})
    else:
        add_all_of(node, {"anyOf": [{"properties": {name: False}},
                                    {"allOf": [{"required": [name]}, dep]}]})


_RULES: tuple[Callable[[RewriteContext, str, dict[str, Any], list[Rewrite]], None], ...] = (
    _format, _lone_condition, _not_not, _not_type, _not_required, _not_property_names,
    _dependencies, one_of_disjoint, one_of_required, _enum_filter)
"""In order: the ``not`` rules run before the ``enum`` filter, which would otherwise take
nodes they rewrite into plain keywords."""
