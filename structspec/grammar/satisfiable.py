"""Does a JSON Schema accept any finite value? Checked before compile, in every mode.

xgrammar compiles some schemas that no output can satisfy into grammars that still let the
model start: ``{"not": {}}`` (``not`` is ignored: any JSON is accepted, all of it invalid) and
a required property that refers back to its own object with no base case
(``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}``: the grammar
emits ``{"a": {"a": ...`` until the token limit). Such a request is refused with a 400.

The check is a least fixpoint over the schema's subschemas (document nodes reached through
the schema keywords and local ``$ref``): a node *can finish* when some finite JSON value
satisfies what is modelled of it, given which other nodes can finish. Only these keywords can
make a node fail: ``false``, ``not`` of an always-true schema, an empty ``enum``, ``$ref``,
``allOf`` / ``anyOf`` / ``oneOf``, and per ``type`` (inferred as ``object`` when only
``properties`` is given, as xgrammar does) the ``required`` properties of an object (declared
in ``properties``, or forbidden by ``additionalProperties: false``) and the first ``minItems``
items of an array. Everything else counts as satisfiable, so the check refuses a schema only
when no finite value can be valid (it may miss other contradictions, e.g. ``minimum`` above
``maximum``, which the compiler or the output check reports).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from structspec.grammar.errors import GrammarError
from structspec.schema_structure import (
    escape_pointer_token,
    find_structure_problem,
    resolve_local_ref,
)

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "id", "$anchor", "$defs", "definitions",
})
LOCAL = "<local>"
"""What :func:`_blocker` returns when the node's own keywords accept nothing (not a pointer:
pointers are empty or start with ``/``)."""
_CHILD_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_CHILD_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_CHILD_SINGLE = ("additionalProperties", "additionalItems", "unevaluatedItems",
                 "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then",
                 "else")


def find_unsatisfiable(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema``, or None when one may.

    Args:
        schema: a parsed JSON Schema (dict or boolean); its structure already checked
            (:func:`~structspec.schema_structure.find_structure_problem`).

    Returns:
        A reason naming the JSON pointer where the chain of required values ends without a
        possible value, e.g. ``"/properties/a: a required value refers back to / with no
        finite way out"``; None otherwise.
    """
    if schema is False:
        return "/: the schema is false (it accepts no value)"
    if not isinstance(schema, dict):
        return None
    nodes = dict(_collect(schema))
    finite: set[str] = set()
    changed = True
    while changed:  # least fixpoint: a node joins once its requirements can all finish
        changed = False
        for pointer, node in nodes.items():
            if pointer not in finite and _blocker(node, pointer, schema, finite) is None:
                finite.add(pointer)
                changed = True
    if "" in finite:
        return None
    return _explain(schema, nodes, finite)


def _collect(root: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every dict subschema reachable from ``root`` as ``(pointer, node)``, each once."""
    seen: set[str] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict) or pointer in seen:
            continue
        seen.add(pointer)
        yield pointer, node
        for pair in _children(node, pointer):
            stack.append(pair)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve_local_ref(root, ref)
            if target is not None:
                stack.append(target)


def _children(node: dict[str, Any], pointer: str) -> Iterator[tuple[str, Any]]:
    for key in _CHILD_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                yield f"{pointer}/{key}/{escape_pointer_token(name)}", child
    for key in _CHILD_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield f"{pointer}/{key}/{i}", child
    for key in _CHILD_SINGLE:
        if key in node:
            yield f"{pointer}/{key}", node[key]
    items = node.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield f"{pointer}/items/{i}", child
    elif items is not None:
        yield f"{pointer}/items", items


def _ok(child: Any, pointer: str, finite: set[str]) -> bool:
    """Whether the subschema ``child`` (at ``pointer``) can finish, as known so far."""
    if isinstance(child, bool):
        return child
    if isinstance(child, dict):
        return pointer in finite
    return True  # not a schema: the compiler reports it


def _always_true(node: Any) -> bool:
    return node is True or (isinstance(node, dict) and set(node) <= _ANNOTATIONS)


def _blocker(node: dict[str, Any], pointer: str, root: Any,
             finite: set[str]) -> str | None:
    """The pointer of the subschema that keeps ``node`` from finishing (:data:`LOCAL` for a
    reason in ``node`` itself), or None when it can finish given ``finite``."""
    if "not" in node and _always_true(node["not"]):
        return LOCAL
    enum = node.get("enum")
    if isinstance(enum, list) and not enum:
        return LOCAL
    if "const" in node or isinstance(enum, list):
        return None  # a listed value is finite (siblings are the output check's business)
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_local_ref(root, ref)
        if target is not None and not _ok(target[1], target[0], finite):
            return target[0]
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        for i, child in enumerate(all_of):
            if not _ok(child, f"{pointer}/allOf/{i}", finite):
                return f"{pointer}/allOf/{i}"
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(
                _ok(child, f"{pointer}/{key}/{i}", finite) for i, child in enumerate(branches)):
            return LOCAL
    types = node.get("type")
    if types is None and isinstance(node.get("properties"), dict):
        types = "object"  # xgrammar reads a schema with properties as an object schema
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not types:
        return None
    blockers = [_type_blocker(node, pointer, t, finite) for t in types]
    if any(b is None for b in blockers):
        return None
    return blockers[0]


def _type_blocker(node: dict[str, Any], pointer: str, type_name: Any,
                  finite: set[str]) -> str | None:
    if type_name == "object":
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = node.get("required")
        for name in required if isinstance(required, list) else ():
            # (a required name missing from 'properties' is dropped by xgrammar: the grammar
            # still ends, and the output check reports the value invalid)
            if isinstance(name, str) and name in props:
                where = f"{pointer}/properties/{escape_pointer_token(name)}"
                if not _ok(props[name], where, finite):
                    return where
        return None
    if type_name == "array":
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return None
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft-04 tuple form
            prefix, items = items, node.get("additionalItems")
            key = "items"
        else:
            key = "prefixItems"
        prefix = prefix if isinstance(prefix, list) else []
        for i in range(min(min_items, len(prefix))):
            if not _ok(prefix[i], f"{pointer}/{key}/{i}", finite):
                return f"{pointer}/{key}/{i}"
        if min_items > len(prefix) and items is not None:
            rest = "additionalItems" if key == "items" else "items"
            if not _ok(items, f"{pointer}/{rest}", finite):
                return f"{pointer}/{rest}"
        return None
    return None


def _explain(root: dict[str, Any], nodes: dict[str, dict[str, Any]],
             finite: set[str]) -> str:
    """Follow the blockers from the root to a local contradiction or back to a node already
    on the path (a cycle with no base case)."""
    path: list[str] = []
    pointer = ""
    while True:
        path.append(pointer)
        node = nodes.get(pointer)
        if node is None:
            return f"{pointer or '/'}: the schema accepts no value"
        blocker = _blocker(node, pointer, root, finite)
        if blocker is None or blocker == LOCAL:
            return f"{pointer or '/'}: {_local_reason(node)}"
        if blocker in path:
            return (f"{pointer or '/'}: a required value refers back to {blocker or '/'} "
                    "with no finite way out (the output would never end)")
        if blocker not in nodes:  # a boolean false subschema
            return f"{blocker}: the schema is false (it accepts no value)"
        pointer = blocker


def _local_reason(node: dict[str, Any]) -> str:
    if "not" in node and _always_true(node["not"]):
        if len(node) == 1:  # {"not": {}}: also the object form of the schema false
            return "the schema accepts no value (false, or 'not' of a schema that accepts everything)"
        return "'not' of a schema that accepts everything accepts no value"
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return "an empty 'enum' accepts no value"
    return "no branch of its 'anyOf' / 'oneOf' accepts a value"


def check_servable(schema: Any, param: str | None) -> None:
    """The checks every grammar path runs on a JSON Schema before compiling it: its structure
    (depth, local ``$ref`` s; :func:`~structspec.schema_structure.find_structure_problem`) and
    whether it admits any finite JSON value (:func:`find_unsatisfiable`).

    Raises:
        GrammarError: naming ``param`` (the request field), with the problem.
    """
    problem = find_structure_problem(schema)
    if problem is not None:
        raise GrammarError(f"json_schema cannot be served: {problem}", param=param)
    problem = find_unsatisfiable(schema)
    if problem is not None:
        raise GrammarError(f"json_schema accepts no finite JSON value: {problem}", param=param)
