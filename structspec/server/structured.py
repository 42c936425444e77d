"""Request fields -> one :data:`~structspec.core.GrammarConstraint` (or none).

Accepted shapes (the union of what sglang, vLLM, TensorRT-LLM and llama.cpp clients send):

- ``response_format``: ``{"type": "text"}``; ``{"type": "json_object"}`` (with an optional
  ``schema``, llama.cpp); ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`` (OpenAI, what ``client.chat.completions.parse(response_format=Model)`` sends);
  ``{"type": "json", "schema": ...}`` (TensorRT-LLM); ``{"type": "regex", "regex"|"pattern"}``;
  ``{"type": "ebnf"|"grammar"|"gbnf", "ebnf"|"grammar"}``; ``{"type": "choice",
  "choices"|"choice"}``; ``{"type": "structural_tag", "format": {...}}`` (xgrammar's
  structural tag, vLLM and sglang) or its legacy form ``{"type": "structural_tag",
  "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (vLLM), with an optional
  ``strict`` (structspec's: strict mode for the tag's JSON Schemas; default false).
- extra body keys: ``json_schema``, ``regex``, ``ebnf``, ``grammar``, ``choice`` (sglang,
  llama.cpp), ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (vLLM < 0.12), ``structured_outputs: {json, regex, choice, grammar, json_object,
  structural_tag}`` (vLLM >= 0.12; ``structural_tag`` is the tag as JSON text, vLLM's type, or
  as an object).

At most one constraint per request (a 400 names both otherwise). JSON grammars get default
number bounds, a loop guard (:mod:`structspec.grammar.number_bounds`);
``structured_outputs: {"bounded_numbers": false}`` lifts them for the request's JSON grammar,
wherever it was given (a 400 when the request has no JSON grammar). Nothing in these objects is
ignored: a ``response_format`` key its type does not read (:data:`RESPONSE_FORMAT_KEYS`), two
spellings of one value (``regex`` and ``pattern``), and an unknown key of
``response_format.json_schema`` or ``structured_outputs`` are a 400 naming the key. ``json_schema.strict``
maps to :attr:`JsonSchemaConstraint.strict`; when a client leaves it out we follow OpenAI's default
(``false``: best effort). With either value the finished output is checked afterwards and
``schema_valid`` reported. A structural tag is read and checked here
(:func:`structspec.constraint_parse.structural_tag_constraint`: a problem inside it is a 400
naming its place, ``response_format.structures[0].schema``); its JSON Schemas get the same
treatment as a ``json_schema``'s in the engine, and ``schema_valid`` checks each tagged
section's JSON body when the tag is ``triggered_tags`` of JSON Schema bodies
(:func:`structspec.scheduler.validate.check_tag_output`).
Whether a schema / regex / grammar actually compiles is decided by the grammar compiler in
the engine process; its error comes back asynchronously and becomes a 400 there. The engine
names the field from the grammar *kind* (``regex``, ``json_schema``, ...), not
from where the client put it, so :func:`grammar_and_field` also returns the field the grammar
was read from and :func:`structspec.server.generation.error_for` names that one instead.

Each value is checked and built by :mod:`structspec.constraint_parse` (worded by its
:data:`~structspec.constraint_parse.API_STYLE`), as the CLI's are; this module knows where a
client may put a grammar, and which one wins.
"""

from __future__ import annotations

from typing import Any

from structspec import constraint_parse as cp
from structspec.constraints import (
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    StructuralTagConstraint,
)
from structspec.server.errors import bad_request
from structspec.server.field_policy import given_keys, refuse_unknown_keys, unknown_key_error
from structspec.server.jsontext import loads_client_json
from structspec.server.protocol import ResponseFormat, SamplingRequest, StructuredOutputs

Found = tuple[GrammarConstraint, str]
"""A grammar and the request field it was read from (the ``param`` of its errors)."""


def grammar_from_request(req: SamplingRequest) -> GrammarConstraint | None:
    """The grammar a request asks for (see :func:`grammar_and_field`).

    Raises:
        APIError: as :func:`grammar_and_field`.
    """
    return grammar_and_field(req)[0]


def grammar_and_field(req: SamplingRequest, forced: tuple[str, Found] | None = None
                      ) -> tuple[GrammarConstraint | None, str | None]:
    """The grammar a request asks for and the request field it was read from, e.g.
    ``"regex"``, ``"json_schema"``, ``"response_format.regex"``,
    ``"response_format.json_schema"``, ``"structured_outputs.grammar"``; ``(None, None)``
    when there is none. ``forced``: one more constraint and its field, from outside the
    grammar fields (a forced tool call's arguments, ``("tool_choice", ...)``).

    Raises:
        APIError: 400 for an unknown ``response_format.type``, a missing or mistyped
            constraint value, or more than one constraint.
    """
    try:
        return _grammar_and_field(req, forced)
    except cp.ConstraintFieldError as e:  # a value refused: the 400 names its field
        raise bad_request(str(e), e.field) from None


def _grammar_and_field(req: SamplingRequest, forced: tuple[str, Found] | None
                       ) -> tuple[GrammarConstraint | None, str | None]:
    found: list[tuple[str, Found]] = []
    if req.response_format is not None:
        got = _from_response_format(req.response_format)
        if got is not None:
            found.append(("response_format", got))
    if req.json_schema is not None:
        found.append(("json_schema", (_schema_constraint(req.json_schema, "json_schema",
                                                         strict=None), "json_schema")))
    if req.guided_json is not None:
        found.append(("guided_json", (_schema_constraint(req.guided_json, "guided_json",
                                                         strict=None), "guided_json")))
    for name in ("regex", "guided_regex"):
        value = getattr(req, name)
        if value is not None:
            found.append((name, (cp.regex_constraint(value, name, cp.API_STYLE), name)))
    for name in ("ebnf", "grammar", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            found.append((name, (cp.ebnf_constraint(value, name, cp.API_STYLE), name)))
    for name in ("choice", "guided_choice"):
        value = getattr(req, name)
        if value is not None:
            found.append((name, (cp.choice_constraint(value, name, cp.API_STYLE), name)))
    if req.structured_outputs is not None:
        got = _from_structured_outputs(req.structured_outputs)
        if got is not None:
            found.append(("structured_outputs", got))
    if forced is not None:  # a forced tool call's arguments (server/tool_calls.py)
        found.append(forced)
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"only one structured-output constraint may be given; got {names}",
                          found[1][0])
    grammar, field = found[0][1] if found else (None, None)
    if req.structured_outputs is not None and req.structured_outputs.bounded_numbers is False:
        # the loop guard lifted for the request's JSON grammar, wherever it was given
        grammar = cp.without_number_bounds(grammar, "structured_outputs.bounded_numbers")
    return grammar, field


RESPONSE_FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "text": (),
    "json_object": ("schema", "strict"),
    "json_schema": ("json_schema", "schema", "strict"),
    "json": ("schema", "strict"),
    "regex": ("regex", "pattern"),
    "ebnf": ("ebnf", "grammar"),
    "grammar": ("ebnf", "grammar"),
    "gbnf": ("ebnf", "grammar"),
    "choice": ("choices", "choice"),
    "structural_tag": ("format", "structures", "triggers", "strict"),
}
"""The keys (besides ``type``) each ``response_format`` type reads; any other key given a
value is a 400 naming it: it would be ignored (``{"type": "json_schema", "regex": ...}``)."""

_ALTERNATIVES = (("regex", "pattern"), ("ebnf", "grammar"), ("choices", "choice"))
"""Keys that are two spellings of one value: give one."""

JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
"""The keys of OpenAI's ``response_format.json_schema`` object."""


def _check_response_format_keys(rf: ResponseFormat, kind: str) -> None:
    """Refuse a key ``kind`` does not read, two spellings of one value, an unknown key of
    ``json_schema``, and two different ``strict`` values.

    Raises:
        APIError: 400 naming the key.
    """
    given = given_keys(rf)
    given.pop("type", None)
    allowed = RESPONSE_FORMAT_KEYS[kind]
    for key in given:
        if key not in allowed:
            if key in ResponseFormat.model_fields or any(
                    f.alias == key for f in ResponseFormat.model_fields.values()):
                takes = ", ".join(allowed) if allowed else "no other key"
                raise bad_request(f"response_format type {kind!r} does not take {key!r} "
                                  f"(it takes {takes})", f"response_format.{key}")
            raise unknown_key_error("response_format", key, ("type", *allowed))
    for a, b in _ALTERNATIVES:
        if a in given and b in given:
            raise bad_request(f"response_format: give {a!r} or {b!r}, not both",
                              f"response_format.{b}")
    js = rf.json_schema
    if js is not None:
        refuse_unknown_keys(js, "response_format.json_schema", JSON_SCHEMA_KEYS)
        if js.schema_ is not None and rf.schema_ is not None:
            raise bad_request("response_format: give the schema in json_schema.schema or in "
                              "schema, not both", "response_format.schema")
        if js.strict is not None and rf.strict is not None and js.strict != rf.strict:
            raise bad_request("response_format: json_schema.strict and strict differ",
                              "response_format.strict")
    if ("strict" in given and "schema" not in given and kind != "structural_tag"
            and (js is None or js.schema_ is None)):
        raise bad_request("response_format.strict applies to a JSON Schema; none is given",
                          "response_format.strict")


def _from_response_format(rf: ResponseFormat) -> Found | None:
    kind = rf.type
    if kind not in RESPONSE_FORMAT_KEYS:
        raise bad_request(
            f"unknown response_format type {kind!r}; expected text, json_object, "
            "json_schema, json, regex, ebnf, grammar, gbnf, choice or structural_tag",
            "response_format.type")
    _check_response_format_keys(rf, kind)
    if kind == "text":
        return None
    if kind == "structural_tag":
        # the tag is response_format itself, less structspec's "strict"
        given = given_keys(rf)
        given.pop("strict", None)
        return cp.structural_tag_constraint(given, "response_format", cp.API_STYLE,
                                            strict=bool(rf.strict)), "response_format"
    if kind == "json_object":
        if rf.schema_ is not None:  # llama.cpp: json_object constrained by a schema
            return _schema_constraint(rf.schema_, "response_format.schema",
                                      strict=rf.strict), "response_format.schema"
        return JsonObjectConstraint(), "response_format"
    if kind == "json_schema":
        js = rf.json_schema
        if js is not None and js.schema_ is not None:
            strict = js.strict if js.strict is not None else rf.strict
            # Compile errors name the OpenAI object (as OpenAI does), not its 'schema' key.
            return _schema_constraint(js.schema_, "response_format.json_schema.schema",
                                      strict=strict), "response_format.json_schema"
        if rf.schema_ is not None:
            return _schema_constraint(rf.schema_, "response_format.schema",
                                      strict=rf.strict), "response_format.schema"
        raise bad_request("response_format type 'json_schema' needs json_schema.schema",
                          "response_format.json_schema")
    if kind == "json":  # TensorRT-LLM
        if rf.schema_ is None:
            return JsonObjectConstraint(), "response_format"
        return _schema_constraint(rf.schema_, "response_format.schema",
                                  strict=rf.strict), "response_format.schema"
    if kind == "regex":
        if rf.regex is None and rf.pattern is None:
            raise bad_request("response_format type 'regex' needs 'regex' (or 'pattern')",
                              "response_format.regex")
        key = "regex" if rf.regex is not None else "pattern"
        param = f"response_format.{key}"
        return cp.regex_constraint(getattr(rf, key), param, cp.API_STYLE), param
    if kind in ("ebnf", "grammar", "gbnf"):
        if rf.ebnf is None and rf.grammar is None:
            raise bad_request(f"response_format type {kind!r} needs 'ebnf' (or 'grammar')",
                              "response_format.ebnf")
        key = "ebnf" if rf.ebnf is not None else "grammar"
        param = f"response_format.{key}"
        return cp.ebnf_constraint(getattr(rf, key), param, cp.API_STYLE), param
    # choice
    if rf.choices is None and rf.choice is None:
        raise bad_request("response_format type 'choice' needs 'choices'",
                          "response_format.choices")
    key = "choices" if rf.choices is not None else "choice"
    param = f"response_format.{key}"
    return cp.choice_constraint(getattr(rf, key), param, cp.API_STYLE), param


STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object",
                           "structural_tag", "bounded_numbers")
"""The keys of vLLM's ``structured_outputs`` the server reads (``bounded_numbers`` is
structspec's: ``false`` lifts the default number bounds of the request's JSON grammar, a
structural tag's JSON Schemas included); another key (vLLM's ``disable_any_whitespace``, a
misspelling) is a 400."""


def _from_structured_outputs(so: StructuredOutputs) -> Found | None:
    refuse_unknown_keys(so, "structured_outputs", STRUCTURED_OUTPUTS_KEYS)
    found: list[tuple[str, GrammarConstraint]] = []
    if so.json_ is not None:
        found.append(("json", _schema_constraint(so.json_, "structured_outputs.json",
                                                 strict=None)))
    if so.regex is not None:
        found.append(("regex", cp.regex_constraint(so.regex, "structured_outputs.regex",
                                                   cp.API_STYLE)))
    if so.choice is not None:
        found.append(("choice", cp.choice_constraint(so.choice, "structured_outputs.choice",
                                                     cp.API_STYLE)))
    if so.grammar is not None:
        found.append(("grammar", cp.ebnf_constraint(so.grammar, "structured_outputs.grammar",
                                                    cp.API_STYLE)))
    if so.json_object:
        found.append(("json_object", JsonObjectConstraint()))
    if so.structural_tag is not None:
        found.append(("structural_tag", _structural_tag_constraint(so.structural_tag)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"structured_outputs takes one of json, regex, choice, grammar, "
                          f"json_object, structural_tag; got {names}", "structured_outputs")
    if not found:
        return None
    key, spec = found[0]
    return spec, f"structured_outputs.{key}"


def _structural_tag_constraint(value: Any) -> StructuralTagConstraint:
    """vLLM's ``structured_outputs.structural_tag``: the tag as JSON text (vLLM's type) or as
    an object; its JSON Schemas best effort, as ``structured_outputs.json``'s.

    Raises:
        ConstraintFieldError: a value that is not a tag (naming its place in the tag).
        APIError: JSON text the parser refuses, naming the field.
    """
    param = "structured_outputs.structural_tag"

    def loads(text: str) -> Any:
        return loads_client_json(text, what=f"{param} (a string)", param=param)

    return cp.structural_tag_constraint(value, param, cp.API_STYLE, strict=False, loads=loads)


def _schema_constraint(value: Any, param: str, *,
                       strict: bool | None) -> JsonSchemaConstraint:
    """A JSON Schema given as an object, a boolean, or JSON text; ``strict`` None (left out by
    the client) is OpenAI's default, best effort.

    Raises:
        ConstraintFieldError: a value of another type, or a structure the engine refuses.
        APIError: JSON text the parser refuses (not only a ``JSONDecodeError``: deep nesting,
            huge integer literals, located): the client's input, so a 400 naming ``param``.
    """

    def loads(text: str) -> Any:
        return loads_client_json(text, what=f"{param} (a string)", param=param)

    return cp.json_schema_constraint(value, param, cp.API_STYLE, strict=bool(strict),
                                     loads=loads)

