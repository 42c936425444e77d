"""One JSON Schema as the engine serves it on xgrammar: its exact rewrites, its default number
bounds, its strict-mode refusal, and the words of a compile failure.

Shared by the ``json_schema`` kind (:mod:`structspec.grammar.compile_spec`) and the JSON
Schemas inside a structural tag (:mod:`structspec.grammar.structural_tag_grammar`), so that a
schema gets the same treatment wherever a request puts it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar.bounded_validator import pattern_budget
from structspec.grammar.errors import GrammarError
from structspec.grammar.number_bounds import bound_schema_numbers
from structspec.grammar.schema_check import MAX_POINTERS_SHOWN, find_unenforceable
from structspec.grammar.schema_rewrite import rewrite_schema, rewrite_schema_text
from structspec.grammar.xgr_numbers import bounded_json_schema_grammar
from structspec.schema_structure import resolve_pointer

T = TypeVar("T")

STRICT_OFF = "set strict to false (best effort)"
"""How a request turns strict mode off, in a refusal's last sentence."""


def schema_text(spec: JsonSchemaConstraint) -> str:
    """The compile input of a schema: :meth:`JsonSchemaConstraint.canonical_text` (compact
    JSON, key order kept; ``ValueError`` for text that is not JSON or a schema that is not an
    object/boolean) after the exact rewrites of
    :func:`~structspec.grammar.schema_rewrite.rewrite_schema_text` (unknown ``format`` values
    dropped, ``not``/``dependencies``/``oneOf`` forms the backends enforce). The cache key stays
    the canonical text."""
    return rewrite_schema_text(spec.canonical_text())


def served_schema(spec: JsonSchemaConstraint, *, rewrite: bool = True) -> Any:
    """The parsed schema xgrammar is given for ``spec``: its exact rewrite (or, with
    ``rewrite=False``, the schema as sent), with the default number bounds unless
    ``spec.bounded_numbers`` is false (:func:`~structspec.grammar.number_bounds.bound_schema_numbers`).

    Raises:
        ValueError: text that is not JSON, or a schema that is not an object/boolean.
    """
    schema = json.loads(schema_text(spec) if rewrite else spec.canonical_text())
    return bound_schema_numbers(schema) if spec.bounded_numbers else schema


def json_schema_grammar(spec: JsonSchemaConstraint, *, any_whitespace: bool,
                        rewrite: bool = True) -> xgr.Grammar:
    """xgrammar's grammar of ``spec`` as a ``json_schema`` request compiles it: strict mode
    (no properties beyond those declared unless the schema allows them), ``any_whitespace``,
    and with ``bounded_numbers`` the bounded any-value number rules too
    (:func:`~structspec.grammar.xgr_numbers.bounded_json_schema_grammar`).

    Raises:
        ValueError: as :func:`served_schema`.
        Exception: xgrammar's refusal of the schema (RuntimeError, ValueError...).
    """
    text = json.dumps(served_schema(spec, rewrite=rewrite), ensure_ascii=False)
    if spec.bounded_numbers:
        return bounded_json_schema_grammar(text, any_whitespace=any_whitespace)
    return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace, strict_mode=True)


def or_unrewritten(spec: JsonSchemaConstraint, build: Callable[[bool], T], *,
                   param: str | None, where: str = "") -> T:
    """``build(True)`` (from the exact rewrite); when xgrammar does not take the rewrite's
    forms (a property absent as ``"name": false``, for ``dependencies``), the schema as sent,
    as before the rewrites: refused in strict mode naming the original's unenforceable
    keywords, ``build(False)`` in best effort.

    Args:
        spec: the schema.
        build: compiles or converts it; its argument is whether to use the rewrite.
        param: the field a strict refusal names.
        where: the schema's place in a structural tag (:func:`strict_refusal`), or ``""``.

    Raises:
        GrammarError: the original's unenforceable keywords (strict mode).
        Exception: ``build``'s own error, when the schema as sent fails too (or nothing was
            rewritten).
    """
    try:
        return build(True)
    except Exception:
        if schema_text(spec) == spec.canonical_text():
            raise
        if spec.strict:
            check_enforceable(json.loads(spec.canonical_text()), param, where=where)
            raise
        return build(False)


def check_enforceable(schema: Any, param: str | None, original_text: str | None = None, *,
                      where: str = "") -> None:
    """Refuse ``schema`` in strict mode (:func:`strict_refusal`).

    Raises:
        GrammarError: naming ``param``, when strict mode cannot enforce the schema exactly.
    """
    message = strict_refusal(schema, original_text, STRICT_OFF, where=where)
    if message is not None:
        raise GrammarError(message, param=param)


def strict_refusal(schema: Any, original_text: str | None, best_effort: str, *,
                   where: str = "") -> str | None:
    """Strict mode's refusal of ``schema`` (what xgrammar compiles), naming each usage it
    would not enforce exactly by its JSON pointer (at most ``MAX_POINTERS_SHOWN``), or None
    when there is none.

    Args:
        schema: the parsed schema xgrammar is given (after the exact rewrites).
        original_text: the client's schema as JSON text, when ``schema`` is its rewrite (or
            None): when a pointer exists only in the rewrite (``/allOf/0/anyOf/1`` for a
            ``dependentRequired``), the refusal names the client's keywords that were
            rewritten, and that another backend may enforce the rewrite.
        best_effort: how the caller's client turns strict mode off (``set strict to false
            (best effort)``).
        where: the schema's place in a structural tag (``structures[0].schema``), or ``""``
            for a ``json_schema`` grammar: the refusal then speaks of that schema and puts the
            place before each pointer (``structures[0].schema/properties/x``).
    """
    if not isinstance(schema, dict):
        return None
    problems = find_unenforceable(schema)
    if not problems:
        return None
    shown_problems = problems[:MAX_POINTERS_SHOWN]
    shown = "; ".join(f"{where}{p or ('' if where else '/')}: {r}" for p, r in shown_problems)
    more = (f" (and {len(problems) - MAX_POINTERS_SHOWN} more)"
            if len(problems) > MAX_POINTERS_SHOWN else "")
    rewrite = ""
    if original_text is not None:
        original = json.loads(original_text)
        if any(resolve_pointer(original, p) is None for p, _ in shown_problems):
            with pattern_budget():  # the rewrite's regex searches, as in rewrite_schema_text
                _, done = rewrite_schema(original)
            # the rules that add structure (the others only drop or filter)
            forms = ", ".join(f"{d.rule!r} at {where}{d.pointer or ('' if where else '/')}"
                              for d in done
                              if d.rule not in ("format", "enum-filter", "lone-if"))
            rewrite = (f" (these name the engine's exact rewrite of {forms}, which xgrammar "
                       "does not enforce" + ("" if where else
                                             "; the llguidance grammar backend may") + ")")
    subject = (f"structural_tag: the JSON Schema at {where}" if where else "json_schema")
    return (subject + " cannot be enforced exactly in strict mode: " + shown + more + rewrite
            + f". Remove these keywords or {best_effort}.")


def metaschema_problem(spec: JsonSchemaConstraint) -> str | None:
    """Where ``spec``'s schema breaks its metaschema (the draft its ``$schema`` names, else
    2020-12), as ``"invalid JSON Schema at <JSON pointer>: <reason>"``; None when it does not,
    or when the ``jsonschema`` package is missing or cannot check it.

    Used only to explain a compile failure: schemas that xgrammar compiles are never refused
    for a metaschema violation (it may accept older drafts' forms).
    """
    try:
        import jsonschema
        from jsonschema.exceptions import best_match

        schema = json.loads(spec.canonical_text())  # the user's schema, not its rewrite
        cls = jsonschema.validators.validator_for(schema,
                                                  default=jsonschema.Draft202012Validator)
        error = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except Exception:  # noqa: BLE001 - an explanation only; the compile error stands alone
        return None
    if error is None:
        return None
    # absolute_path: best_match may pick an error of a sub-schema check (anyOf of type's
    # forms), whose own path is relative to that sub-instance
    pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1")
                      for p in error.absolute_path)
    return f"invalid JSON Schema at {pointer or '/'}: {error.message}"


def compiler_message(e: BaseException) -> str:
    """The useful part of an xgrammar exception: its last line, without the ``[time]
    file.cc:line:`` prefix its C++ checks add."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines else type(e).__name__
    if msg.startswith("[") and ": " in msg:
        head, _, rest = msg.partition(": ")
        if ".cc:" in head or ".h:" in head:
            msg = rest
    return msg
