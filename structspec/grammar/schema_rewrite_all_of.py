"""The ``allOf`` merge and the ``minProperties`` split of the exact schema rewrites: an
``allOf`` (with the node's own keywords) merged into one schema, and ``minProperties: 1``
beside optional properties split into an ``anyOf``.

Both run as passes of their own after the other rules
(:func:`structspec.grammar.schema_rewrite.rewrite_schema`); the rules, and why each is exact,
are in the rule table of :mod:`structspec.grammar.schema_rewrite` (its module docstring).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from structspec.grammar.schema_check import ASSERTIONS
from structspec.grammar.schema_rewrite_context import (
    ID_KEYS,
    Rewrite,
    RewriteContext,
    add_all_of,
    subschemas,
    type_set,
    type_value,
)
from structspec.schema_structure import escape_pointer_token as _escape
from structspec.schema_structure import resolve_local_ref

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


def all_of_merge(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                 done: list[Rewrite]) -> None:
    """The node's own keywords and its ``allOf`` branches merged into one schema
    (``allOf-merge``), when :func:`_merge` can."""
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


def _merge(ctx: RewriteContext, parts: list[Any], depth: int) -> dict[str, Any]:
    """The one schema that accepts exactly what every part accepts (the rule table in
    :mod:`structspec.grammar.schema_rewrite`).

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
            found = type_set(part["type"])
            if found is None:
                raise _NotMergeable
            types = found if types is None else types & found
    if types is not None:
        value = type_value(types)
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


def _flatten(ctx: RewriteContext, part: Any, depth: int, flat: list[dict[str, Any]]) -> None:
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


def _merge_property(ctx: RewriteContext, subs: list[Any], depth: int) -> Any:
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
    return any(isinstance(sub.get(k), str) for _, sub in subschemas(node, "")
               for k in (*ID_KEYS, "id"))


# ---------------------------------------------------------------------------------------------
# minProperties (a third pass, only for a schema xgrammar refuses anyway)
# ---------------------------------------------------------------------------------------------


def min_properties_form(node: dict[str, Any]) -> bool:
    """Whether ``node`` has ``minProperties: 1`` beside a listed property it does not
    require (which llguidance refuses)."""
    value = node.get("minProperties")
    props = node.get("properties")
    if isinstance(value, bool) or value != 1 or not isinstance(props, dict) or not props:
        return False
    required = node.get("required")
    return not (isinstance(required, list) and set(props) <= set(required))


def min_properties(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                   done: list[Rewrite]) -> None:
    """``minProperties: 1`` of a node :func:`min_properties_form` takes: dropped beside a
    ``required`` name, else split into an ``anyOf`` (``minProperties``)."""
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
        add_all_of(node, {"anyOf": branches})
    else:
        node["anyOf"] = branches
    done.append(Rewrite(pointer, "minProperties",
                        f"'minProperties': 1 beside optional properties became anyOf "
                        f"[required one of {len(names)} names, none of them and another]"))
