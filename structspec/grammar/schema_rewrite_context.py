"""What the exact schema rewrites share: the :class:`Rewrite` record, the
:class:`RewriteContext` of the document being rewritten, the walk over its subschemas and small
helpers on keywords, types and value lists.

The rule table (why each rewrite is exact), the driver and the simple rules are in
:mod:`structspec.grammar.schema_rewrite`; the ``oneOf`` rules in
:mod:`structspec.grammar.schema_rewrite_one_of`; the ``allOf`` merge and the
``minProperties`` split in :mod:`structspec.grammar.schema_rewrite_all_of`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from structspec.grammar.bounded_validator import bounded_validator
from structspec.grammar.schema_check import ASSERTIONS
from structspec.schema_structure import escape_pointer_token as _escape
from structspec.schema_structure import resolve_local_ref

TYPES = ("null", "boolean", "object", "array", "string", "integer", "fraction")
"""JSON instance types, with numbers split into integers and non-integers ("fraction")."""

ID_KEYS = ("$id", "$anchor", "$dynamicAnchor")
"""Keywords that set a base URI or an anchor. Draft-04's ``id`` is looked for only on
subschemas (:func:`subschemas`): anywhere else a key ``id`` may be a property name."""

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
            ``allOf-merge``, ``minProperties``, ``ref-pointer``).
        detail: what was done, for logs and tests.
    """

    pointer: str
    rule: str
    detail: str


class RewriteContext:
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
                isinstance(sub.get(k), str) for pointer, sub in subschemas(self.root, "")
                if pointer for k in (*ID_KEYS, "id"))
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


def subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema dict under ``node``, children before their parent (so a parent's
    rule sees its children rewritten); ``$ref`` is not followed (its target is visited where
    it lives)."""
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in list(sub.items()):
                yield from subschemas(child, f"{pointer}/{key}/{_escape(name)}")
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield from subschemas(child, f"{pointer}/{key}/{i}")
    for key in _SCHEMA_SINGLE:
        yield from subschemas(node.get(key), f"{pointer}/{key}")
    items = node.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield from subschemas(child, f"{pointer}/items/{i}")
    else:
        yield from subschemas(items, f"{pointer}/items")
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, child in deps.items():
            yield from subschemas(child, f"{pointer}/dependencies/{_escape(name)}")
    yield pointer, node


def uses(node: Any, keys: frozenset[str]) -> bool:
    """Whether any dict anywhere in ``node`` has one of ``keys``."""
    if isinstance(node, dict):
        return bool(keys & set(node)) or any(uses(v, keys) for v in node.values())
    if isinstance(node, list):
        return any(uses(v, keys) for v in node)
    return False


def only(node: Any, *keys: str) -> bool:
    """Whether ``node`` is a dict whose assertion keywords are exactly ``keys``."""
    return isinstance(node, dict) and (set(node) & ASSERTIONS) == set(keys)


def type_set(types: Any) -> set[str] | None:
    """The instance types of a ``type`` value (numbers split), or None when malformed."""
    names = [types] if isinstance(types, str) else types
    if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
        return None
    out: set[str] = set()
    for t in names:
        if t == "number":
            out |= {"integer", "fraction"}
        elif t in TYPES and t != "fraction":
            out.add(t)
        else:
            return None
    return out


def type_value(types: set[str]) -> list[str] | None:
    """A ``type`` list for an instance-type set, or None when it has non-integer numbers
    without the integers (no ``type`` says that)."""
    if "fraction" in types and "integer" not in types:
        return None
    out = [t for t in TYPES if t in types and t not in ("integer", "fraction")]
    if "fraction" in types:
        out.append("number")
    elif "integer" in types:
        out.append("integer")
    return out


def follow_refs(ctx: RewriteContext, node: Any, *, bare_only: bool) -> tuple[Any, bool]:
    """Follow ``node``'s chain of ``$ref`` nodes (``bare_only``: only those with no other
    assertion beside the ``$ref``), at most 16 hops.

    Returns:
        ``(the last node reached, whether the chain ended)``: False when a reference does not
        resolve here or the chain is longer.
    """
    for _ in range(16):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)
                and (not bare_only or len(set(node) & ASSERTIONS) == 1)):
            return node, True
        target = resolve_local_ref(ctx.root, node["$ref"])
        if target is None:
            return node, False
        node = target[1]
    return node, False


def deref(ctx: RewriteContext, node: Any) -> Any:
    """``node`` with its chain of bare ``$ref`` nodes (no other assertion beside the
    ``$ref``) followed; the last node reached when a reference does not resolve."""
    return follow_refs(ctx, node, bare_only=True)[0]


def finite_values(node: Any) -> list[Any] | None:
    """The values a subschema's own ``enum``/``const`` allows (before its other keywords),
    or None when it has neither."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    return None


def add_all_of(node: dict[str, Any], schema: Any) -> None:
    """Append ``schema`` to ``node``'s ``allOf`` (created when absent; existing branches keep
    their pointers)."""
    node["allOf"] = [*node.get("allOf", []), schema]
