"""A structural tag -> xgrammar's input, each JSON Schema in it served as a ``json_schema``
request's would be.

The tag is read and checked by :mod:`structspec.structural_tag` (the legacy form converted to
the current one). Each JSON Schema in it then gets the treatment of a
:class:`~structspec.constraints.JsonSchemaConstraint` with the tag's ``strict`` and
``bounded_numbers`` (:mod:`structspec.grammar.schema_grammar`): the exact rewrites (the schema
as sent when xgrammar does not take a rewrite's forms), the satisfiability check, in strict
mode the refusal of keywords xgrammar would not enforce, and the default number bounds.

A ``json_schema`` format with the default ``style`` (``json``) and none of ``any_order``,
``max_whitespace_cnt``, ``excludes`` becomes a ``grammar`` format holding exactly the grammar a
``json_schema`` request compiles (xgrammar's strict-mode conversion with the engine's
``any_whitespace``, the bounded any-value number rules): xgrammar's own structural-tag
conversion would allow any whitespace between tokens, a loop a small model can fall into. The
other ``json_schema`` formats (XML styles, those options) and ``qwen_xml_parameter`` keep
xgrammar's conversion, of the rewritten schema with its default number bounds.

Errors about one schema name its place: ``param`` ``structural_tag.structures[0].schema``
and the message names it with the schema's JSON pointer (``structures[0].schema/properties/x``).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint, StructuralTagConstraint
from structspec.grammar.errors import GrammarError
from structspec.grammar.satisfiable import find_unsatisfiable
from structspec.grammar.schema_grammar import (
    check_enforceable,
    compiler_message,
    json_schema_grammar,
    metaschema_problem,
    or_unrewritten,
    schema_text,
    served_schema,
)
from structspec.structural_tag import (
    ReadTag,
    SchemaSite,
    StructuralTagError,
    field_name,
    read_structural_tag,
)

PARAM = "structural_tag"
"""The field a structural tag is named by in the engine's errors (a place in it follows)."""


def read_tag(spec: StructuralTagConstraint) -> ReadTag:
    """``spec``'s tag, read and checked (:func:`~structspec.structural_tag.read_structural_tag`).

    Raises:
        GrammarError: text that is not a JSON object, or the reader's refusal, naming the
            place (``param`` ``structural_tag.structures[0].begin``).
    """
    try:
        tag = spec.parsed_tag()
    except ValueError as e:
        raise GrammarError(str(e), param=PARAM) from None
    try:
        return read_structural_tag(tag)
    except StructuralTagError as e:
        where = f" {e.where}:" if e.where else ""
        raise GrammarError(f"structural_tag:{where} {e}",
                           param=field_name(PARAM, e.where)) from None


def check_structural_tag(spec: StructuralTagConstraint) -> ReadTag:
    """The checks before compiling: the tag's shape (:func:`read_tag`) and, for each JSON
    Schema, that some finite JSON value satisfies it and (``spec.strict``) that xgrammar
    enforces it exactly.

    Returns:
        The read tag.

    Raises:
        GrammarError: the first problem, naming its place.
    """
    read = read_tag(spec)
    for site in read.schemas:
        schema_spec = site_constraint(spec, site)
        param = field_name(PARAM, site.where)
        schema = json.loads(schema_text(schema_spec))
        problem = find_unsatisfiable(schema)
        if problem is not None:
            raise GrammarError(f"structural_tag: the JSON Schema at {site.where} accepts no "
                               f"finite JSON value: {problem}", param=param)
        if spec.strict:
            check_enforceable(schema, param, schema_spec.canonical_text(), where=site.where)
    return read


def site_constraint(spec: StructuralTagConstraint, site: SchemaSite) -> JsonSchemaConstraint:
    """The JSON Schema constraint a schema of the tag is served as (the tag's ``strict`` and
    ``bounded_numbers``)."""
    return JsonSchemaConstraint(site.schema, strict=spec.strict,
                                bounded_numbers=spec.bounded_numbers)


def structural_tag_input(spec: StructuralTagConstraint, *, any_whitespace: bool) -> str:
    """The JSON text xgrammar compiles for ``spec`` (module docstring): the current form, each
    JSON Schema replaced by what the engine serves for it.

    Args:
        spec: the structural tag.
        any_whitespace: the engine's JSON whitespace (``False``: xgrammar's compact
            separators), as for a ``json_schema`` request.

    Raises:
        GrammarError: the tag's shape, or a JSON Schema xgrammar refuses (or, strict, whose
            exact rewrite it does not take and whose original it would not enforce), naming
            the place.
    """
    read = read_tag(spec)
    tag = copy.deepcopy(read.tag)
    for site in read.schemas:
        *parents, last = site.path
        holder: Any = tag
        for key in parents:
            holder = holder[key]
        holder[last] = _served_format(spec, site, holder[last], any_whitespace=any_whitespace)
    return json.dumps(tag, ensure_ascii=False, separators=(",", ":"))


def _served_format(spec: StructuralTagConstraint, site: SchemaSite, fmt: dict[str, Any], *,
                   any_whitespace: bool) -> dict[str, Any]:
    """The format that replaces ``fmt`` (the format holding ``site``'s schema)."""
    schema_spec = site_constraint(spec, site)
    param = field_name(PARAM, site.where)
    plain = (fmt.get("type") == "json_schema" and fmt.get("style", "json") == "json"
             and not fmt.get("any_order") and fmt.get("max_whitespace_cnt") is None
             and not fmt.get("excludes"))
    try:
        if plain:
            grammar = or_unrewritten(
                schema_spec, lambda rewrite: json_schema_grammar(
                    schema_spec, any_whitespace=any_whitespace, rewrite=rewrite),
                param=param, where=site.where)
            return {"type": "grammar", "grammar": str(grammar)}

        def converted(rewrite: bool) -> Any:
            schema = served_schema(schema_spec, rewrite=rewrite)
            # xgrammar's converter takes it (else: the schema as sent)
            xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False),
                                         strict_mode=True)
            return schema

        schema = or_unrewritten(schema_spec, converted, param=param, where=site.where)
        return {**fmt, "json_schema": schema}
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        message = compiler_message(e)
        problem = metaschema_problem(schema_spec)
        if problem is not None:
            message = f"{problem} (compiler: {message})"
        raise GrammarError(f"Failed to compile structural_tag grammar: the JSON Schema at "
                           f"{site.where}: {message}", param=param) from e
