"""``jsonschema`` validators whose regex matching has a time limit.

The engine checks JSON Schema keywords on the host in three places: a finished output's
``schema_valid`` verdict (:mod:`structspec.scheduler.validate`, inside the engine's step), the
exact schema rewrites (:mod:`structspec.grammar.schema_rewrite`, at compile) and the strict
check of ``enum``/``const`` values against their siblings
(:mod:`structspec.grammar.schema_check`). ``jsonschema`` matches ``pattern`` and
``patternProperties`` with Python's backtracking ``re``, so a client's pattern such as
``^(a|a)*$`` against a 40-character string runs for hours with the GIL held: one request
would stall every other one. Here those keywords (and ``additionalProperties``, which matches
the ``patternProperties`` keys) run on the ``regex`` package with a per-search time limit;
a search over it raises :class:`PatternTimeLimit`, which each caller treats as "cannot tell"
(no verdict, no rewrite, not proven). Each caller also runs its whole document under
:func:`pattern_budget`, so a schema with many such patterns costs one budget, not one limit
per pattern. ``regex`` reads patterns as ``re`` does (its version 0
mode), so verdicts within the limit are unchanged.

``unevaluatedProperties`` evaluates ``patternProperties`` through ``jsonschema``'s own code,
which this module cannot bound, so a document that uses both gets no validator
(:func:`bounded_validator` returns None).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import regex

#: seconds one regex search may take (a client's pattern against one string)
PATTERN_TIME_LIMIT_S = 0.05
#: seconds all the searches of one document's check may take together (:func:`pattern_budget`)
DOCUMENT_TIME_BUDGET_S = 0.25

#: the deadline (``time.perf_counter()`` seconds) of the check running in this context
_DEADLINE: ContextVar[float | None] = ContextVar("pattern_deadline", default=None)


@contextlib.contextmanager
def pattern_budget(total_s: float = DOCUMENT_TIME_BUDGET_S) -> Iterator[None]:
    """Bound every :func:`bounded_search` inside the block by one shared deadline ``total_s``
    seconds away (each search keeps its own limit too); once it has passed, every search
    raises :class:`PatternTimeLimit` at once. Nested blocks keep the earlier deadline."""
    deadline = time.perf_counter() + total_s
    outer = _DEADLINE.get()
    token = _DEADLINE.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


class PatternTimeLimit(RuntimeError):
    """A ``pattern`` / ``patternProperties`` search ran past :data:`PATTERN_TIME_LIMIT_S`, or
    the document's :func:`pattern_budget` was spent."""


def bounded_search(pattern: str, text: str) -> bool:
    """``re.search(pattern, text) is not None`` within :data:`PATTERN_TIME_LIMIT_S`.

    Inside :func:`pattern_budget` the search also ends at the block's deadline.

    Raises:
        PatternTimeLimit: the search ran past its limit, or the budget was spent.
        regex.error: ``pattern`` is not a valid regular expression.
    """
    limit = PATTERN_TIME_LIMIT_S
    deadline = _DEADLINE.get()
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise PatternTimeLimit("the document's regex time budget is spent")
        limit = min(limit, left)
    try:
        return regex.search(pattern, text, timeout=limit) is not None
    except TimeoutError as e:
        raise PatternTimeLimit(
            f"pattern {pattern[:80]!r} took more than {limit:.3f} s on a "
            f"{len(text)}-character string") from e


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not bounded_search(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any,
                        schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if bounded_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any,
                           schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in instance
              if k not in properties and not any(bounded_search(p, k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        yield ValidationError("additional properties are not allowed ("
                              + ", ".join(repr(k) for k in sorted(extras, key=str)) + ")")


@functools.cache
def _bounded_class(base: type) -> type:
    import jsonschema

    return jsonschema.validators.extend(base, {
        "pattern": _pattern, "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties})


def _uses_both(node: Any) -> bool:
    """Whether ``unevaluatedProperties`` and ``patternProperties`` both occur as keys
    anywhere under ``node`` (a conservative walk: data under ``enum`` counts too)."""
    wanted = {"unevaluatedProperties", "patternProperties"}
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.update(wanted.intersection(item))
            if found == wanted:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def bounded_validator(schema: Any, *, default: type | None = None,
                      **kwargs: Any) -> Any | None:
    """A validator of ``schema`` (the draft its ``$schema`` names, else ``default``, else
    2020-12) whose regex keywords are bounded, or None when ``schema`` uses
    ``unevaluatedProperties`` together with ``patternProperties`` (see the module doc).

    ``kwargs`` go to the validator (e.g. ``registry``). Its ``validate`` / ``is_valid`` /
    ``iter_errors`` raise :class:`PatternTimeLimit` when a search runs past the limit.
    """
    import jsonschema

    if _uses_both(schema):
        return None
    base = jsonschema.validators.validator_for(
        schema, default=default or jsonschema.Draft202012Validator)
    return _bounded_class(base)(schema, **kwargs)
