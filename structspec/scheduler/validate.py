"""After-the-fact validation of finished outputs (the ``schema_valid`` field)."""

from __future__ import annotations

import json

from structspec.constraints import GrammarConstraint, JsonObjectConstraint, JsonSchemaConstraint


def check_schema_output(spec: GrammarConstraint, text: str) -> bool | None:
    """True/False when the spec is JSON-typed and ``text`` does/doesn't validate; else None.

    JSON Schema outputs are checked with the ``jsonschema`` package (the draft named by the
    schema's ``$schema``, else the latest it knows), with an empty reference registry: a
    ``$ref`` is never retrieved over the network (jsonschema's default would fetch it, with
    no timeout, from a URL the client chose), and its regex searches are time-limited
    (:mod:`~structspec.grammar.bounded_validator`: a client's backtracking pattern would hold
    the GIL for hours). A schema the validator cannot use, or a pattern over its time limit,
    gives no verdict (None) instead of an exception: this check runs inside the engine's
    step.
    """
    if not isinstance(spec, (JsonSchemaConstraint, JsonObjectConstraint)):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if isinstance(spec, JsonObjectConstraint):
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:  # optional at run time (e.g. a GPU host without it): no verdict
        return None

    import referencing

    from structspec.grammar.bounded_validator import bounded_validator, pattern_budget

    try:
        schema = json.loads(spec.canonical_text())
        validator = bounded_validator(schema, registry=referencing.Registry())
        if validator is None:  # regex keywords that cannot be time-limited
            return None
        with pattern_budget():
            validator.validate(value)
    except jsonschema.ValidationError:
        return False
    except Exception:  # noqa: BLE001 - unresolvable $ref, bad schema, recursion, a pattern
        return None  # over its time limit (PatternTimeLimit): no verdict
    return True
