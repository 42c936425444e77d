"""JSON Schema structure the engine refuses in every mode: too deep, or referring outside
itself. Torch- and xgrammar-free, so the server's front end can check a request before it
pickles it to the engine process (a schema ~250 levels deep overflowed that pickling and
stalled the front end's sender thread)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from structspec.regex_check import find_regex_problem


def escape_pointer_token(token: str) -> str:
    """A key as a JSON Pointer token (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return token.replace("~", "~0").replace("/", "~1")


def pointer_path(root: Any, pointer: str) -> tuple[str | int, ...] | None:
    """The path (dict keys as ``str``, list indices as ``int``) a JSON Pointer names in
    ``root`` (RFC 6901: ``""`` is the root, ``/a/b`` its tokens, each with ``~1`` -> ``/`` and
    ``~0`` -> ``~``); ``None`` when a token names nothing (a missing key, an index past a
    list, a pointer not starting with ``/``)."""
    node, path = root, []
    if pointer:
        if not pointer.startswith("/"):
            return None
        for raw in pointer[1:].split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
                path.append(token)
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
                path.append(int(token))
            else:
                return None
    return tuple(path)


def resolve_pointer(root: Any, pointer: str) -> tuple[str, Any] | None:
    """The value at a JSON Pointer (:func:`pointer_path`) as ``(pointer, value)``; ``None``
    when it names nothing."""
    path = pointer_path(root, pointer)
    if path is None:
        return None
    node = root
    for part in path:
        node = node[part]
    return pointer, node


def resolve_local_ref(root: Any, ref: str) -> tuple[str, Any] | None:
    """Resolve a local reference ``#/a/b`` (a URI fragment: percent-decoded first, RFC 3986,
    as JSON Schema reads ``$ref``, so ``#/$defs/a%20b`` names the key ``a b``) as
    ``(decoded JSON pointer, value)``; ``None`` for remote, anchor or dangling references."""
    if not ref.startswith("#"):
        return None
    return resolve_pointer(root, unquote(ref[1:]))


#: Deepest JSON nesting (objects and arrays) a schema may have. Each schema level is about two
#: JSON levels (``properties`` -> name -> subschema); a schema ~250 levels deep overflowed
#: pickling between the server's processes, and no real schema comes near 128.
MAX_SCHEMA_NESTING = 128

_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
# keywords whose values are instance data, not subschemas: a "$ref" key there is just data
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# keywords whose values map names to subschemas: a key there is a name, never a keyword (a
# property named "enum" holds a schema, not data)
NAME_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                               "dependentSchemas"})


def find_structure_problem(schema: Any) -> str | None:
    """The first reason the engine cannot serve ``schema`` at all, or None.

    Checked in every mode, before the schema is compiled, sent between processes or used to
    validate an output:

    - nesting deeper than :data:`MAX_SCHEMA_NESTING` JSON levels;
    - a ``$ref`` that is not a local reference (``#...``) into the same schema: the engine
      never fetches a schema (a URL would make it issue network requests chosen by the
      client), and xgrammar silently ignores references it cannot resolve;
    - a local ``$ref`` JSON pointer (``#/...``) whose target does not exist;
    - a ``pattern`` or ``patternProperties`` regex with an escape of an unknown letter or an
      empty character class (refused as in the ``regex`` field:
      :func:`~structspec.regex_check.find_regex_problem`).

    The walk is iterative (a deep schema cannot overflow Python's stack here).

    Args:
        schema: a parsed JSON Schema (any JSON value).

    Returns:
        ``"<json pointer>: <reason>"`` (pointer ``/`` for the root), or None.
    """
    # (node, pointer, depth, whether node is a name map: its values are all subschemas)
    stack: list[tuple[Any, str, int, bool]] = [(schema, "", 1, False)]
    while stack:
        node, pointer, depth, names = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_SCHEMA_NESTING:
            return (f"{pointer or '/'}: the schema nests deeper than {MAX_SCHEMA_NESTING} "
                    "levels")
        if isinstance(node, list):
            stack.extend((child, f"{pointer}/{i}", depth + 1, False)
                         for i, child in reversed(list(enumerate(node))))
            continue
        if names:
            stack.extend((child, f"{pointer}/{escape_pointer_token(name)}", depth + 1, False)
                         for name, child in reversed(list(node.items())))
            continue
        for key in _REF_KEYS:
            ref = node.get(key)
            if not isinstance(ref, str):
                continue
            where = f"{pointer}/{escape_pointer_token(key)}"
            if not ref.startswith("#"):
                return (f"{where}: {key} {ref!r} is not a local reference ('#/...'); "
                        "structspec does not fetch schemas, put the definition under $defs")
            # "#/a/b" is a JSON pointer; "#name" an anchor (not resolved here)
            if (key == "$ref" and ref[1:2] in ("", "/")
                    and resolve_local_ref(schema, ref) is None):
                return f"{where}: {key} {ref!r} points to nothing in the schema"
        problem = _pattern_problem(node, pointer)
        if problem is not None:
            return problem
        for name, child in reversed(list(node.items())):
            if name not in DATA_KEYWORDS:
                stack.append((child, f"{pointer}/{escape_pointer_token(name)}", depth + 1,
                              name in NAME_MAP_KEYWORDS))
            elif depth + json_nesting(child) > MAX_SCHEMA_NESTING:  # data: depth only
                return (f"{pointer}/{escape_pointer_token(name)}: the schema nests deeper than "
                        f"{MAX_SCHEMA_NESTING} levels")
    return None


def _pattern_problem(node: dict[str, Any], pointer: str) -> str | None:
    """A ``pattern`` or ``patternProperties`` regex of ``node`` whose meaning differs between
    regex dialects (:func:`~structspec.regex_check.find_regex_problem`: ``\\q``, ``[^]``),
    as the ``regex`` field refuses it: the grammar would enforce something else than the
    client meant, and the output check could not read it."""
    pattern = node.get("pattern")
    if isinstance(pattern, str) and (problem := find_regex_problem(pattern)) is not None:
        return f"{pointer}/pattern: {problem} in {pattern[:80]!r}"
    keys = node.get("patternProperties")
    if isinstance(keys, dict):
        for key in keys:
            if isinstance(key, str) and (problem := find_regex_problem(key)) is not None:
                return (f"{pointer}/patternProperties/{escape_pointer_token(key)}: {problem} "
                        f"in {key[:80]!r}")
    return None


def json_nesting(value: Any) -> int:
    """JSON nesting depth of a value (objects and arrays; 0 for a scalar), counted
    iteratively (a deep value cannot overflow Python's stack) and capped at
    ``MAX_SCHEMA_NESTING + 1``: any result past the limit means "too deep"."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)) and depth <= MAX_SCHEMA_NESTING + 1:
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                 else node))
    return deepest
