"""Local ``$ref`` pointers both grammar backends resolve (the ``ref-pointer`` rewrite).

A ``$ref`` is a URI reference: its fragment is percent-decoded (RFC 3986), then read as a JSON
Pointer whose tokens unescape ``~1`` -> ``/`` and ``~0`` -> ``~`` (RFC 6901). The backends
resolve only part of that (xgrammar 0.2.8 and llguidance 1.9, checked in
``tests/grammar/test_schema_rewrite_refs.py``):

- xgrammar looks each token up as written: ``#/$defs/a~1b``, ``#/$defs/a%20b`` and an array
  index (``#/anyOf/0``) fail to compile; ``#/$defs/a b`` (not a valid URI) works;
- llguidance decodes both escapes but refuses ``#/$defs/a b`` as an invalid URI.

So no spelling of a key with a space, ``/``, ``~`` or a non-ASCII letter works on both. This
rewrite gives each such target a plain name: a copy of the target under the root's ``$defs``
(``structspec_ref_<k>``), and every ``$ref`` to it points there. It is exact: a ``$ref``'s
meaning is its target's, the copy is identical, and the ``$ref`` strings inside the copy are
document pointers, which resolve where they did (a recursive target's references move to its
copy too). Skipped when a subschema below the root sets a base URI or an anchor (a reference
there may resolve from another base).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from structspec.grammar.schema_rewrite_context import Rewrite, RewriteContext, subschemas
from structspec.schema_structure import resolve_local_ref, resolve_pointer

__all__ = ["DEF_PREFIX", "plain_ref", "ref_pointers"]

DEF_PREFIX = "structspec_ref_"
"""Name prefix of the copies under the root's ``$defs``."""

# what a URI fragment holds unescaped (RFC 3986 pchar, "/" and "?"), less "~" (a pointer
# escape) and "%" (a percent escape): read alike whether decoded or not
_PLAIN_TOKEN = re.compile(r"[A-Za-z0-9\-._!$&'()*+,;=:@?]+")


def plain_ref(root: Any, ref: str) -> bool:
    """Whether both backends resolve ``ref`` as written: ``#``, or ``#/`` and tokens of the
    characters a URI fragment holds unescaped, ``~`` excepted (so no escape of either kind),
    none of them indexing a list."""
    if ref == "#":
        return True
    if not ref.startswith("#/"):
        return False
    node = root
    for token in ref[2:].split("/"):
        if not _PLAIN_TOKEN.fullmatch(token) or not isinstance(node, dict):
            return False
        node = node.get(token)
    return True


def ref_pointers(ctx: RewriteContext, done: list[Rewrite]) -> None:
    """Point every local ``$ref`` that is not :func:`plain_ref` at a copy of its target under
    the root's ``$defs`` (module docstring). Leaves dangling, remote and anchor references
    alone (the structure and strict checks report them), and the whole document when it has
    nested base URIs or anchors, or a root ``$defs`` that is not an object.

    Args:
        ctx: the document (``ctx.root`` is modified in place); ``ctx.refs`` is stale after a
            change (the caller recomputes it).
        done: the applied rewrites are appended (``rule`` ``ref-pointer``).
    """
    root = ctx.root
    defs = root.get("$defs", {})
    if not isinstance(defs, dict) or ctx.nested_ids():
        return
    # every subschema holding a $ref: the root's walk, and the targets' (a target may sit
    # under a key that is no keyword); the copies added below are walked by the second pass
    holders: dict[str, dict[str, Any]] = {}
    for pointer, node in subschemas(root, ""):
        holders[pointer] = node
    for _, target in ctx.refs:
        found = resolve_pointer(root, target) if target else None
        if found is not None:
            holders.update(subschemas(found[1], found[0]))
    names: dict[str, str] = {}  # decoded target pointer -> the copy's name
    taken = set(defs)
    for node in holders.values():
        ref = node.get("$ref")
        if not isinstance(ref, str) or plain_ref(root, ref):
            continue
        found = resolve_local_ref(root, ref)
        if found is None or found[0] in names:
            continue
        k = len(names)
        while f"{DEF_PREFIX}{k}" in taken:
            k += 1
        names[found[0]] = f"{DEF_PREFIX}{k}"
        taken.add(names[found[0]])
    if not names:
        return
    # copies taken before any $ref changes: each is its target as the client wrote it
    copies = {name: copy.deepcopy(resolve_pointer(root, p)[1])
              for p, name in names.items()}
    root["$defs"] = defs
    defs.update(copies)
    for name, value in copies.items():
        holders.update(subschemas(value, f"/$defs/{name}"))
    for pointer, node in holders.items():
        ref = node.get("$ref")
        if not isinstance(ref, str) or plain_ref(root, ref):
            continue
        found = resolve_local_ref(root, ref)
        if found is not None and found[0] in names:
            node["$ref"] = f"#/$defs/{names[found[0]]}"
            done.append(Rewrite(pointer, "ref-pointer", f"{ref} -> {node['$ref']}"))

