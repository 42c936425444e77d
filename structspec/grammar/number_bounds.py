"""Loop guard for JSON numbers: default bounds for integer and number schemas.

A JSON Schema ``{"type": "integer"}`` admits integers of any length, and a small model that
starts ``1000000...`` can follow the grammar until ``max_tokens``. :func:`bound_schema_numbers`
returns a copy of a schema in which every integer / number subschema that leaves a side
unbounded gets a default bound on that side:

- ``integer``: ``minimum`` ``-10**18`` / ``maximum`` ``10**18`` (at most 19 digits, inside
  int64; both grammar engines enforce the range exactly).
- ``number`` (also ``["integer", "number"]``): ``minimum`` ``-10**15`` / ``maximum`` ``10**15``.
  xgrammar's range grammar then also allows at most 6 fraction digits and no exponent;
  llguidance's bounds the integer part only.

The copy accepts a subset of what the schema accepts (the output stays valid under the
original schema), and nothing else changes:

- A side the schema bounds itself (``minimum`` / ``exclusiveMinimum``, ``maximum`` /
  ``exclusiveMaximum``) is kept; the other side is added only when the schema's own bound lies
  inside the default range, so no range becomes empty and a schema asking for larger numbers
  keeps them.
- Subschemas with ``enum`` / ``const`` (already finite), ``multipleOf`` (xgrammar drops a
  ``multipleOf`` that has a range beside it) or ``$ref`` siblings are left alone.
- Only subschemas in *positive* places are rewritten (``properties``, ``items``,
  ``anyOf``, ``allOf``, ``then``, ``$defs``, ...), where a narrower subschema can only narrow
  the whole. Under ``not``, ``if``, ``oneOf`` (exactly one branch), ``contains`` and
  ``propertyNames`` a narrower subschema could widen the whole, so nothing there is touched,
  nor any definition a ``$ref`` from there reaches. A ``$ref`` from there that cannot be
  resolved within the schema leaves the whole schema unchanged.

Values of any type (``{}``, ``json_object``) have no numeric keyword to add: for xgrammar
their number rules are bounded in the grammar itself
(:func:`structspec.grammar.xgr_numbers.bound_any_numbers`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from structspec.schema_structure import pointer_path

INTEGER_BOUND = 10**18
"""Default ``|bound|`` of an integer subschema (exact in float64, which llguidance reads)."""

NUMBER_BOUND = 10**15
"""Default ``|bound|`` of a number subschema."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMAS = ("additionalProperties", "additionalItems", "unevaluatedProperties",
            "unevaluatedItems", "then", "else")
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_NEGATIVE = ("not", "if", "oneOf", "contains", "propertyNames")
"""Keywords whose subschemas a narrowing could make the whole schema *accept more*."""

Path = tuple[str | int, ...]


def bound_schema_numbers(schema: Any) -> Any:
    """A copy of ``schema`` with default bounds on its unbounded integers and numbers (module
    doc); ``schema`` itself is not modified. A non-object schema is returned as is."""
    if not isinstance(schema, dict):
        return schema
    blocked = _blocked_paths(schema)
    if blocked is None:
        return schema
    out = copy.deepcopy(schema)
    _rewrite(out, (), blocked)
    return out


def _children(node: dict[str, Any], path: Path) -> Iterator[tuple[Any, Path]]:
    """The subschemas of ``node`` in positive places, with their paths."""
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield sub, (*path, key, name)
    for key in _SCHEMAS:
        if key in node:
            yield node[key], (*path, key)
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield sub, (*path, key, i)
    items = node.get("items")
    if isinstance(items, list):  # draft 4-7 tuple form
        for i, sub in enumerate(items):
            yield sub, (*path, "items", i)
    elif items is not None:
        yield items, (*path, "items")
    deps = node.get("dependencies")  # draft 7: a schema, or a list of names (not a schema)
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, dict):
                yield sub, (*path, "dependencies", name)


def _rewrite(node: Any, path: Path, blocked: set[Path]) -> None:
    if not isinstance(node, dict) or path in blocked:
        return
    _add_bounds(node)
    for sub, sub_path in _children(node, path):
        _rewrite(sub, sub_path, blocked)


def _add_bounds(node: dict[str, Any]) -> None:
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if "number" in kinds:
        bound = NUMBER_BOUND
    elif "integer" in kinds:
        bound = INTEGER_BOUND
    else:
        return
    if any(k in node for k in ("enum", "const", "multipleOf", "$ref")):
        return
    low = _bound(node, "minimum", "exclusiveMinimum")
    high = _bound(node, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high > -bound):
        node["minimum"] = -bound
    if high is None and (low is None or low < bound):
        node["maximum"] = bound


def _bound(node: dict[str, Any], inclusive: str, exclusive: str) -> float | None:
    """The schema's own bound on one side (a number), or None when that side is open (a
    draft-4 boolean ``exclusiveMinimum`` alone bounds nothing)."""
    for key in (inclusive, exclusive):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def _blocked_paths(schema: dict[str, Any]) -> set[Path] | None:
    """Paths of the subschemas in negative places and of every definition a ``$ref`` from
    there reaches (transitively); None when such a ``$ref`` cannot be resolved."""
    blocked: set[Path] = set()
    todo: list[Path] = [p for p in _negative_places(schema, ())]
    while todo:
        path = todo.pop()
        if path in blocked:
            continue
        blocked.add(path)
        for ref in _refs(_at(schema, path)):
            target = _resolve(schema, ref)
            if target is None:
                return None
            todo.append(target)
    # a blocked path blocks everything under it; the root blocked = the whole schema
    if () in blocked:
        return None
    return blocked


def _negative_places(node: Any, path: Path) -> Iterator[Path]:
    """Paths of subschemas under negative keywords, anywhere in ``node`` (a property named
    ``not``, or data that looks like a schema, counts too: blocking more is safe)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _NEGATIVE:
                if isinstance(value, list):
                    yield from ((*path, key, i) for i in range(len(value)))
                else:
                    yield (*path, key)
            yield from _negative_places(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _negative_places(value, (*path, i))


def _refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` string anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(schema: Any, ref: str) -> Path | None:
    """The path (dict keys as str, list indices as int) of the subschema a local JSON-pointer
    ``$ref`` (``#``, ``#/$defs/a``, ``#/$defs/a%20b``) names; None for other refs (anchors,
    other documents) and for a pointer to nothing."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    return pointer_path(schema, unquote(ref[1:]))  # a URI fragment: percent-decoded first


def _at(schema: Any, path: Path) -> Any:
    """The value at a path :func:`_resolve` or the walk produced."""
    node = schema
    for part in path:
        node = node[part]
    return node
