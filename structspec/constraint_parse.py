"""Grammar fields of a request -> checked :mod:`structspec.constraints` objects.

One parser behind the three places a grammar comes in: the ``generate`` flags
(:func:`structspec.cli.grammar_from_args`), the lines of ``generate --batch``
(``structspec.cli._batch_grammar``) and the HTTP server
(:mod:`structspec.server.structured`). Each caller keeps its own surface (argparse flags and
files, JSON lines, pydantic request models) and hands every grammar value here, with the name
it gives the field (``--regex``, ``regex``, ``response_format.json_schema.schema``) and its
:class:`FieldStyle`.

The three callers grew their checks separately and still differ in small, observable ways
(the words of a refusal, whether a blank regex counts as empty, whether a schema may come as
JSON text). Those differences are data in the three styles below, side by side, rather than
code in each caller: :data:`FLAG_STYLE`, :data:`BATCH_STYLE`, :data:`API_STYLE`.

Every refusal is a :class:`ConstraintFieldError` (a ``ValueError``) whose ``field`` is the
caller's name for the field and whose message is worded by the caller's style. Imports nothing
heavy (no torch, no xgrammar, no server code): the CLI's flag checks run before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
    json_type_name,
)
from structspec.regex_check import find_regex_problem
from structspec.schema_structure import find_structure_problem
from structspec.structural_tag import StructuralTagError, field_name, read_structural_tag


class ConstraintFieldError(ValueError):
    """A grammar field's value was refused.

    Attributes:
        field: the field as the caller names it (``--regex``, ``regex``,
            ``response_format.json_schema.schema``): the server's 400 names it as ``param``.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class FieldStyle:
    """How one caller words refusals and reads grammar values.

    Message templates are :meth:`str.format` strings over: ``name`` (the field as the caller
    spells it; ``{name!r}`` quotes it), ``shown`` (the value as JSON, cut to 80 characters),
    ``json_type`` (its JSON type: ``null``, ``string``, ``array``, ...), ``position``
    (1-based index of the first bad item of a choice list; 0 when the list itself is bad),
    ``source`` (where the value was read from, e.g. a file
    name), ``error`` (the JSON parser's message) and ``problem`` (why a schema's structure is
    refused).

    Attributes:
        regex: an empty regex, or one that is not a string.
        ebnf: a blank grammar, or one that is not a string.
        choice: a choice list that is not a non-empty list of non-empty strings.
        boolean: a ``strict`` / ``json_object`` value that is not ``true`` / ``false``.
        schema_text: a schema given as text that is not JSON; None: a string schema is not
            JSON text but a value of the wrong type.
        schema_type: a schema that is not an object or a boolean; None: not checked here (a
            bad one fails its request when the engine compiles it).
        schema_structure: a schema the engine refuses in every mode (too deep, a remote
            ``$ref``: :func:`~structspec.schema_structure.find_structure_problem`); None: not
            checked here (the engine checks it).
        blank_regex_is_empty: a regex of only whitespace counts as empty.
        boolean_schema_as_object: a boolean schema becomes its object form (``{}`` /
            ``{"not": {}}``); else it is kept as JSON text (``"true"`` / ``"false"``).
    """

    regex: str
    ebnf: str
    choice: str
    boolean: str
    schema_text: str | None
    schema_type: str | None
    schema_structure: str | None
    blank_regex_is_empty: bool
    boolean_schema_as_object: bool

    def refuse(self, template: str, name: str, value: object, **extra: object
               ) -> ConstraintFieldError:
        """The error for ``value`` of field ``name``, worded by ``template`` (one of this
        style's). Only the fields the template names are computed: showing a schema the
        structure check refused (too deep) could itself fail."""
        message = template.format_map(_TemplateFields(value, name=name, **extra))
        return ConstraintFieldError(message, name)


class _TemplateFields(dict[str, object]):
    """The fields of a :class:`FieldStyle` template; those derived from the value are
    computed on first use."""

    def __init__(self, value: object, **fields: object) -> None:
        super().__init__(fields)
        self._value = value

    def __missing__(self, key: str) -> str:
        if key == "shown":
            return shown_json(self._value)
        if key == "json_type":
            return json_type_name(self._value)
        raise KeyError(key)


FLAG_STYLE = FieldStyle(
    regex="{name}: empty pattern",
    ebnf="{name}: empty grammar in {source!r}",
    choice="{name}: empty choice (position {position})",
    boolean="{name}: expected true or false, got {shown}",
    schema_text="{name} is neither a file nor valid JSON: {error}",
    schema_type=None,
    schema_structure=None,
    blank_regex_is_empty=False,
    boolean_schema_as_object=False,
)
"""``structspec generate`` flags (``--regex``, ``--json-schema`` ...): argparse already gives
strings (and ``--choice`` at least one); the flag leads the message."""

BATCH_STYLE = FieldStyle(
    regex="{name!r} must be a non-empty string, got {shown}",
    ebnf="{name!r} must be a non-empty string, got {shown}",
    choice="{name!r} must be a non-empty list of non-empty strings, got {shown}",
    boolean="{name!r} must be true or false, got {shown}",
    schema_text=None,
    schema_type="{name!r} must be a JSON Schema object (or true/false), got {json_type}",
    schema_structure=None,
    blank_regex_is_empty=True,
    boolean_schema_as_object=False,
)
"""``generate --batch`` line keys: JSON values of any type; the key is quoted and the value
shown as it was on the line."""

API_STYLE = FieldStyle(
    regex="{name} must be a non-empty string",
    ebnf="{name} must be a non-empty grammar string",
    choice="{name} must be a non-empty list of non-empty strings",
    boolean="{name} must be true or false",
    schema_text="{name} (a string) is not valid JSON: {error}",
    schema_type="{name} must be a JSON Schema object, got {json_type}",
    schema_structure="{name} cannot be served: {problem}",
    blank_regex_is_empty=False,
    boolean_schema_as_object=True,
)
"""HTTP request fields (``regex``, ``guided_choice``, ``response_format.json_schema.schema``):
the 400's ``param`` is the field; its structure is checked before the request is pickled to
the engine process (a very deep schema overflowed that pickling)."""


def regex_constraint(value: object, name: str, style: FieldStyle) -> RegexConstraint:
    """``value`` as a regex constraint (output must fully match it).

    Raises:
        ConstraintFieldError: ``value`` is not a string, or empty (blank too, where
            ``style.blank_regex_is_empty``), worded by ``style.regex``; or it uses syntax the
            grammar compiler would misread (``\\q``, ``[^]``:
            :func:`~structspec.regex_check.find_regex_problem`), in every style.
    """
    if not isinstance(value, str) or not (value.strip() if style.blank_regex_is_empty
                                          else value):
        raise style.refuse(style.regex, name, value)
    problem = find_regex_problem(value)
    if problem is not None:
        raise ConstraintFieldError(f"{name} is not a usable regex: {problem}", name)
    return RegexConstraint(value)


def ebnf_constraint(value: object, name: str, style: FieldStyle, *,
                    source: str = "") -> EbnfConstraint:
    """``value`` as a GBNF grammar constraint (start symbol ``root``).

    Args:
        source: where ``value`` was read from (the ``--ebnf`` file), for the message.

    Raises:
        ConstraintFieldError: ``value`` is not a string, or blank, worded by ``style.ebnf``.
    """
    if not isinstance(value, str) or not value.strip():
        raise style.refuse(style.ebnf, name, value, source=source)
    return EbnfConstraint(value)


def choice_constraint(value: object, name: str, style: FieldStyle) -> ChoiceConstraint:
    """``value`` as a choice constraint (output is exactly one of the strings).

    An empty string is refused here, naming the field: it would be a choice of no text, which
    the grammar backend refuses without a field name.

    Raises:
        ConstraintFieldError: ``value`` is not a non-empty list of non-empty strings, worded
            by ``style.choice``.
    """
    if not isinstance(value, list) or not value:
        raise style.refuse(style.choice, name, value, position=0)
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise style.refuse(style.choice, name, value, position=i + 1)
    return ChoiceConstraint(tuple(value))


def boolean_field(value: object, name: str, style: FieldStyle) -> bool:
    """``value`` as a boolean option (``strict``, ``json_object``), never coerced
    (``"false"`` is not false, ``0`` is not a boolean).

    Raises:
        ConstraintFieldError: ``value`` is not ``True`` / ``False``, worded by
            ``style.boolean``.
    """
    if not isinstance(value, bool):
        raise style.refuse(style.boolean, name, value)
    return value


def json_schema_constraint(value: object, name: str, style: FieldStyle, *, strict: bool,
                           loads: Callable[[str], Any] | None = None
                           ) -> JsonSchemaConstraint:
    """``value`` as a JSON Schema constraint.

    Args:
        value: a schema object (dict), a boolean schema, or, where ``style.schema_text`` is
            set, JSON text of one.
        strict: :attr:`JsonSchemaConstraint.strict` (refuse keywords the grammar cannot
            enforce).
        loads: reads JSON text in place of :func:`json.loads` (the server's reader, which
            also locates an over-long integer literal); its own errors pass through.

    Raises:
        ConstraintFieldError: text that is not JSON (``style.schema_text``) or JSON text of a
            string, a value of
            another type (``style.schema_type``) or a structure the engine refuses
            (``style.schema_structure``).
    """
    schema: Any = value
    if isinstance(schema, str) and style.schema_text is not None:
        schema = (loads(schema) if loads is not None
                  else _json_loads(schema, name, style, style.schema_text))
        if isinstance(schema, str):  # '"abc"': JSON, but a string is no schema (read
            # again as schema text, it was reported as "not valid JSON")
            raise ConstraintFieldError(f"{name}: a JSON string is not a JSON Schema (an "
                                       "object, or true / false)", name)
    if style.schema_type is not None and not isinstance(schema, (dict, bool)):
        raise style.refuse(style.schema_type, name, schema)
    if isinstance(schema, bool):
        # as JSON text, its canonical text is "true" / "false", as the engine reads it
        schema = ({} if schema else {"not": {}}) if style.boolean_schema_as_object \
            else json.dumps(schema)
    if style.schema_structure is not None:
        problem = find_structure_problem(schema)
        if problem is not None:
            raise style.refuse(style.schema_structure, name, schema, problem=problem)
    return JsonSchemaConstraint(schema, strict=strict)


def structural_tag_constraint(value: object, name: str, style: FieldStyle, *, strict: bool,
                              loads: Callable[[str], Any] | None = None
                              ) -> StructuralTagConstraint:
    """``value`` as a structural tag constraint (xgrammar's current form or the legacy
    ``structures`` / ``triggers`` form; :mod:`structspec.structural_tag`).

    Args:
        value: the tag object, or, where ``style.schema_text`` is set, its JSON text.
        name: the field that holds the tag (``response_format``,
            ``structured_outputs.structural_tag``, ``--structural-tag``); a problem inside the
            tag is named after it (``response_format.structures[0].schema``).
        strict: :attr:`StructuralTagConstraint.strict` (refuse keywords of its JSON Schemas
            the grammar cannot enforce; checked by the engine's compile).
        loads: reads JSON text in place of :func:`json.loads` (the server's reader); its own
            errors pass through.

    Raises:
        ConstraintFieldError: text that is not JSON (``style.schema_text``), a value that is
            not an object, or a tag :func:`~structspec.structural_tag.read_structural_tag`
            refuses (unknown keys, empty ``structures``, a trigger that starts no ``begin``, a
            JSON Schema the engine never serves...), naming the place in the tag.
    """
    tag: Any = value
    if isinstance(tag, str) and style.schema_text is not None:
        tag = (loads(tag) if loads is not None
               else _json_loads(tag, name, style, style.schema_text))
    if not isinstance(tag, dict):
        raise ConstraintFieldError(f"{name} must be a structural tag object ({{\"type\": "
                                   f"\"structural_tag\", \"format\": ...}} or {{\"structures\": "
                                   f"..., \"triggers\": ...}}), got {json_type_name(tag)}", name)
    try:
        read_structural_tag(tag)
    except StructuralTagError as e:
        field = field_name(name, e.where)
        raise ConstraintFieldError(f"{field}: {e}", field) from None
    return StructuralTagConstraint(tag, strict=strict)


def _json_loads(text: str, name: str, style: FieldStyle, template: str) -> Any:
    """``json.loads(text)``; a text that is not JSON is refused worded by ``template``.
    Other parser errors (an integer literal over the digit limit) pass through as before."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise style.refuse(template, name, text, error=e) from e


def shown_json(value: object, limit: int = 80) -> str:
    """``value`` as the JSON it was (``null``, ``"false"``, ``[true]``), cut to ``limit``
    characters so that a long value does not flood the error."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def without_number_bounds(grammar: GrammarConstraint | None, name: str) -> GrammarConstraint:
    """``grammar`` (a JSON Schema, ``json_object`` or structural tag constraint) with its
    default number bounds lifted (``bounded_numbers=False``,
    :mod:`structspec.grammar.number_bounds`; for a structural tag, those of its JSON Schemas).

    Raises:
        ConstraintFieldError: ``grammar`` is not a JSON grammar (the option would do nothing),
            naming ``name``.
    """
    if not isinstance(grammar, (JsonSchemaConstraint, JsonObjectConstraint,
                                StructuralTagConstraint)):
        what = "no grammar" if grammar is None else f"a {grammar.kind} grammar"
        raise ConstraintFieldError(f"{name}: applies to a JSON Schema, JSON object or "
                                   f"structural tag grammar; this request has {what}", name)
    return dataclasses.replace(grammar, bounded_numbers=False)
