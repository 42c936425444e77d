"""After-the-fact validation of finished outputs (the ``schema_valid`` field)."""

from __future__ import annotations

import json

from structspec.core import GrammarSpec, JsonObjectSpec, JsonSchemaSpec


def check_schema_output(spec: GrammarSpec, text: str) -> bool | None:
    """True/False when the spec is JSON-typed and ``text`` does/doesn't validate; else None.

    JSON Schema outputs are checked with the ``jsonschema`` package (the draft named by the
    schema's ``$schema``, else the latest it knows).
    """
    if not isinstance(spec, (JsonSchemaSpec, JsonObjectSpec)):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if isinstance(spec, JsonObjectSpec):
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:  # optional at run time (e.g. a GPU host without it): no verdict
        return None

    schema = json.loads(spec.canonical_text())
    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls(schema).validate(value)
    except jsonschema.ValidationError:
        return False
    except (jsonschema.SchemaError, RecursionError, ValueError, TypeError):
        return None  # the schema itself cannot be checked by the validator
    return True
