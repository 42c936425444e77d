"""The ``oneOf`` rules of the exact schema rewrites: ``oneOf`` -> ``anyOf`` when the branches
are provably pairwise disjoint (with the proofs of disjointness), and ``oneOf`` of ``required``
lists as an exclusive ``anyOf``.

The rules, and why each is exact, are in the rule table of
:mod:`structspec.grammar.schema_rewrite` (its module docstring), which runs them.
"""

from __future__ import annotations

import itertools
from typing import Any

from structspec.grammar.bounded_validator import PatternTimeLimit
from structspec.grammar.schema_check import _provably_disjoint as _disjoint_by_check
from structspec.grammar.schema_check import _types_of
from structspec.grammar.schema_rewrite_context import (
    TYPES,
    Rewrite,
    RewriteContext,
    deref,
    finite_values,
    follow_refs,
    only,
    type_set,
)


def one_of_disjoint(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                    done: list[Rewrite]) -> None:
    """``oneOf`` -> ``anyOf`` when the branches are pairwise disjoint, or there is one
    (``oneOf-disjoint``)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches or "anyOf" in node:
        return
    # the instances the branches are told apart on: those of the node's own type
    within = (type_set(node["type"]) if "type" in node else None) or set(TYPES)
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


def _pairwise_disjoint(ctx: RewriteContext, branches: list[Any], within: set[str]) -> bool:
    """Whether no instance of the ``within`` types matches two of ``branches`` (then
    ``oneOf`` == ``anyOf`` in a node whose ``type`` allows only those)."""
    targets = [_target(ctx, b) for b in branches]
    if (all(isinstance(t, dict) and _possible_types(ctx, t) & within <= {"object"}
            for t in targets) and _disjoint_by_check(targets, ctx.root)):
        return True  # objects only, told apart by one discriminator property (linear time)
    return all(_disjoint(ctx, a, b, within) for a, b in itertools.combinations(branches, 2))


def _disjoint(ctx: RewriteContext, a: Any, b: Any, within: set[str], depth: int = 0) -> bool:
    """Whether no instance of the ``within`` types matches both ``a`` and ``b`` (the proofs of
    the rule table in :mod:`structspec.grammar.schema_rewrite`; False when none applies).
    ``$ref`` is followed whatever its siblings: a schema with a ``$ref`` accepts at most what
    the target accepts, in every draft."""
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
               and _disjoint(ctx, props_a[n], props_b[n], set(TYPES), depth + 1)
               for n in sorted(required_a & required_b))


def _target(ctx: RewriteContext, node: Any) -> Any:
    """``node`` with its ``$ref`` chain followed (None for a reference that does not resolve
    here: in draft-07 and earlier the keywords beside it mean nothing)."""
    target, ended = follow_refs(ctx, node, bare_only=False)
    return target if ended else None


def _possible_types(ctx: RewriteContext, node: dict[str, Any]) -> set[str]:
    """The instance types (:data:`TYPES`) ``node`` may accept (all when unknown)."""
    found = _types_of(node, ctx.root)
    if found is None:
        return set(TYPES)
    out: set[str] = set()
    for t in found:
        out |= {"integer", "fraction"} if t == "number" else ({t} & set(TYPES))
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


def _without_empty_overlap(ctx: RewriteContext, branches: list[Any]) -> list[Any] | None:
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


def _finite_excluded(ctx: RewriteContext, a: Any, b: Any) -> bool:
    """Whether ``a`` accepts finitely many values (``enum``/``const``, or a string ``pattern``
    ``^literal$``) and ``b`` none of them (checked with ``jsonschema``)."""
    a = deref(ctx, a)
    values = finite_values(a)
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


MAX_EXCLUSIVE_BRANCHES = 64
"""Most ``anyOf`` branches the ``oneOf`` of ``required`` rule writes (their number is a
product of the other branches' name counts)."""


def one_of_required(ctx: RewriteContext, pointer: str, node: dict[str, Any],
                    done: list[Rewrite]) -> None:
    """``oneOf`` of ``required`` lists -> ``anyOf`` of exclusive branches
    (``oneOf-required``)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2 or "anyOf" in node:
        return
    sets: list[list[str]] = []
    for branch in branches:
        names = branch.get("required") if only(branch, "required") else None
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            return
        sets.append(list(dict.fromkeys(names)))
    allowed = type_set(node["type"]) if "type" in node else set(TYPES)
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
    # ordered by size, then by names: a set's own order follows the string hash seed, and
    # the rewritten text (a compile cache key) must be the same in every process
    choices = sorted({frozenset(c) for c in itertools.product(*groups)},
                     key=lambda c: (len(c), sorted(c)))
    kept: list[frozenset[str]] = []
    for c in choices:
        if not any(k <= c for k in kept):
            kept.append(c)
    return [sorted(c) for c in kept]
