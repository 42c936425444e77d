"""After-the-fact validation of finished outputs (the ``schema_valid`` field)."""

from __future__ import annotations

import json
from typing import Any

from structspec.constraints import (
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    StructuralTagConstraint,
)


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

    A structural tag gets a verdict when it is a ``triggered_tags`` tag (the legacy
    ``structures`` form is one) whose tags all hold a plain JSON Schema body
    (:func:`check_tag_output`): each tagged section's body is checked against its schema.
    """
    if isinstance(spec, StructuralTagConstraint):
        return check_tag_output(spec, text)
    if not isinstance(spec, (JsonSchemaConstraint, JsonObjectConstraint)):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if isinstance(spec, JsonObjectConstraint):
        return isinstance(value, dict)
    try:
        schema = json.loads(spec.canonical_text())
    except Exception:  # noqa: BLE001 - no verdict rather than an error inside the step
        return None
    return _validate(schema, value)


def _validate(schema: Any, value: Any) -> bool | None:
    """``value`` against ``schema`` (module rules above); None: no verdict."""
    try:
        import jsonschema
    except ImportError:  # optional at run time (e.g. a GPU host without it): no verdict
        return None

    import referencing

    from structspec.grammar.bounded_validator import bounded_validator, pattern_budget

    try:
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


def tag_json_sections(tag: dict[str, Any]) -> list[tuple[str, Any, str]] | None:
    """``(begin, schema, end)`` of each tag of a structural tag whose format is one
    ``triggered_tags`` of tags with a plain JSON Schema body (``json_schema`` content in the
    default ``json`` style), in the legacy form or the current one; None for any other tag
    (nested formats, other bodies, XML styles), which gets no verdict."""
    if "structures" in tag:
        items = tag.get("structures")
        if not isinstance(items, list):
            return None
        out = [(s.get("begin"), s.get("schema"), s.get("end")) for s in items
               if isinstance(s, dict)]
    else:
        fmt = tag.get("format")
        if not isinstance(fmt, dict) or fmt.get("type") != "triggered_tags":
            return None
        out = []
        for t in fmt.get("tags") or []:
            content = t.get("content") if isinstance(t, dict) else None
            if (not isinstance(content, dict) or content.get("type") != "json_schema"
                    or content.get("style", "json") != "json"):
                return None
            out.append((t.get("begin"), content.get("json_schema"), t.get("end")))
    if not out or any(not isinstance(b, str) or not b or not isinstance(e, str)
                      for b, _, e in out):
        return None
    return out


def check_tag_output(spec: StructuralTagConstraint, text: str) -> bool | None:
    """Whether each tagged section of ``text`` holds a body valid under its tag's schema.

    Sections are found left to right: the earliest ``begin`` string of any tag (the longest
    at that place), then the JSON value after it (``json.JSONDecoder.raw_decode``, leading
    whitespace skipped, so an end string inside a JSON string does not end the body), then
    that tag's ``end`` string (whitespace before it allowed). False: a body that does not
    parse (cut short), one its schema refuses, or a missing end; True: every section valid
    (also when there is none: free text is in the tag's language); None: a tag of another
    shape (:func:`tag_json_sections`) or a schema the validator cannot use.
    """
    try:
        sections = tag_json_sections(spec.parsed_tag())
    except ValueError:
        return None
    if sections is None:
        return None
    decoder = json.JSONDecoder()
    verdict: bool | None = True
    pos = 0
    while True:
        found = [(text.find(b, pos), -len(b), k) for k, (b, _, _) in enumerate(sections)]
        found = [f for f in found if f[0] >= 0]
        if not found:
            return verdict
        at, neg_len, k = min(found)
        _, schema, end = sections[k]
        body_at = at - neg_len
        while body_at < len(text) and text[body_at].isspace():
            body_at += 1
        try:
            value, after = decoder.raw_decode(text, body_at)
        except json.JSONDecodeError:
            return False
        rest = after
        while rest < len(text) and text[rest].isspace() and not text.startswith(end, rest):
            rest += 1
        if not text.startswith(end, rest):
            return False
        ok = _validate(schema, value)
        if ok is False:
            return False
        if ok is None:
            verdict = None
        pos = rest + len(end)
