"""Grammar constraints: what output shape a request asks for (compiled by
:mod:`structspec.grammar`).

Plain frozen records with no torch or xgrammar import, so the HTTP front end, the CLI and the
Python API can build and check them cheaply. ``kind`` names the grammar family and
``canonical_text()`` is the compile-cache key. (These were called ``*Spec`` before 0.2; the old
names stay importable from :mod:`structspec` and :mod:`structspec.core` as deprecated aliases.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def json_type_name(value: object) -> str:
    """The JSON name of ``value``'s type (``null``, ``string``, ...), for error messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class JsonSchemaConstraint:
    """Output must be JSON valid under ``schema`` (a JSON Schema, as a dict or JSON text).

    ``strict=True`` (OpenAI's ``json_schema.strict``) rejects schemas that use keywords the
    grammar cannot enforce; ``strict=False`` generates best effort and validates afterwards.

    ``bounded_numbers=True`` (the default) is a loop guard: integers and numbers the schema
    leaves unbounded get default bounds (integers within ``[-10**18, 10**18]``, numbers within
    ``[-10**15, 10**15]``; with xgrammar also at most 6 fraction digits, and numbers of
    values of any type at most 16 + 6 + 2 digits), so a model cannot write digits until
    ``max_tokens``; every output still follows the schema
    (:mod:`structspec.grammar.number_bounds`). ``False`` compiles the schema as it is.

    Raises:
        TypeError: ``strict`` or ``bounded_numbers`` is not ``True`` / ``False`` (``"no"`` is
            truthy: it used to mean strict), naming the field.
    """

    schema: str | dict[str, Any]
    strict: bool = True
    bounded_numbers: bool = True

    def __post_init__(self) -> None:
        for name in ("strict", "bounded_numbers"):
            value: object = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"JsonSchemaConstraint.{name} must be True or False, got "
                                f"{type(value).__name__} {value!r}")

    @property
    def kind(self) -> str:
        return "json_schema"

    def canonical_text(self) -> str:
        """The schema re-serialised compactly, key order kept (xgrammar emits properties in
        declaration order, so order is part of the grammar).

        Raises:
            ValueError: when ``schema`` is text that is not JSON, or not a JSON object/bool.
        """
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {json_type_name(schema)}")
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class JsonObjectConstraint:
    """Output must be any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    ``bounded_numbers=True`` (the default): with xgrammar, the object's numbers have at most
    18 digits as integers, else 16 integer + 6 fraction + 2 exponent digits (a loop guard;
    see :class:`JsonSchemaConstraint`). llguidance leaves them unbounded.

    Raises:
        TypeError: ``bounded_numbers`` is not ``True`` / ``False``.
    """

    bounded_numbers: bool = True

    def __post_init__(self) -> None:
        value: object = self.bounded_numbers
        if not isinstance(value, bool):
            raise TypeError(f"JsonObjectConstraint.bounded_numbers must be True or False, got "
                            f"{type(value).__name__} {value!r}")

    @property
    def kind(self) -> str:
        return "json_object"

    def canonical_text(self) -> str:
        return ""


@dataclass(frozen=True)
class RegexConstraint:
    """Output must fully match ``pattern``.

    Raises:
        TypeError: ``pattern`` is not a string, naming ``pattern``.
        ValueError: ``pattern`` is empty (it matches only the empty output, which is never
            what a caller means), naming ``pattern``.
    """

    pattern: str

    def __post_init__(self) -> None:
        pattern: object = self.pattern
        if not isinstance(pattern, str):
            raise TypeError(f"RegexConstraint.pattern must be a str, got "
                            f"{type(pattern).__name__} {pattern!r}")
        if not pattern:
            raise ValueError("RegexConstraint.pattern must be a non-empty regular expression, "
                             "got ''")

    @property
    def kind(self) -> str:
        return "regex"

    def canonical_text(self) -> str:
        return self.pattern


@dataclass(frozen=True)
class EbnfConstraint:
    """Output must be a sentence of the GBNF grammar ``grammar`` (start symbol ``root``).

    Raises:
        TypeError: ``grammar`` is not a string, naming ``grammar`` (it failed later, outside
            any one request, and took the whole ``generate`` call down). A string that is
            not a grammar is refused per request by the grammar backend.
    """

    grammar: str

    def __post_init__(self) -> None:
        grammar: object = self.grammar
        if not isinstance(grammar, str):
            raise TypeError(f"EbnfConstraint.grammar must be a str, got "
                            f"{type(grammar).__name__} {grammar!r}")

    @property
    def kind(self) -> str:
        return "ebnf"

    def canonical_text(self) -> str:
        return self.grammar


@dataclass(frozen=True)
class ChoiceConstraint:
    """Output must be exactly one of ``choices``.

    A list is stored as a tuple (the constraint is frozen and hashed as a grammar cache key). An
    empty tuple or an empty choice is left to the grammar backend, which refuses it as a
    request error (``choice_ebnf``).

    Raises:
        ValueError: ``choices`` is a bare string (it would be split into its characters),
            not a list/tuple, or holds an item that is not a string; naming ``choices``.
    """

    choices: tuple[str, ...]

    def __post_init__(self) -> None:
        choices: object = self.choices
        # A str is a Sequence of str: ChoiceConstraint("abc") used to mean the choices a / b / c.
        if not isinstance(choices, (list, tuple)):
            raise ValueError(f"choices must be a list or tuple of strings, got "
                             f"{type(choices).__name__} {choices!r}")
        for i, c in enumerate(choices):
            if not isinstance(c, str):  # str(None) / str(1) would become a choice
                raise ValueError(f"choices[{i}] must be a string, got {type(c).__name__} "
                                 f"{c!r}")
        if not isinstance(choices, tuple):
            object.__setattr__(self, "choices", tuple(choices))

    @property
    def kind(self) -> str:
        return "choice"

    def canonical_text(self) -> str:
        return json.dumps(list(self.choices))


@dataclass(frozen=True)
class StructuralTagConstraint:
    """Free text with tagged sections (xgrammar's structural tag): the model writes anything
    until it writes a trigger (``<function=``), then the tagged section is forced: a begin
    string, a body that follows the tag's format (a JSON Schema, typically) and an end string.
    Tool calls in "auto" mode with arguments that follow their schema.

    ``tag`` is xgrammar's current form, ``{"type": "structural_tag", "format": {...}}``, or
    the legacy form of vLLM, ``{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}``, as a dict or JSON text (:mod:`structspec.structural_tag` reads both). Each JSON
    Schema in it is served as a :class:`JsonSchemaConstraint` with the same ``strict`` and
    ``bounded_numbers`` would be (the exact rewrites, the strict check naming the schema's
    place in the tag, the default number bounds, the JSON whitespace of the engine).
    xgrammar only: ``--grammar-backend llguidance`` refuses it and ``auto`` serves it on
    xgrammar. No ``schema_valid`` verdict (it stays None).

    Raises:
        TypeError: ``tag`` is neither a dict nor a string, or ``strict`` /
            ``bounded_numbers`` is not ``True`` / ``False``, naming the field.
    """

    tag: str | dict[str, Any]
    strict: bool = True
    bounded_numbers: bool = True

    def __post_init__(self) -> None:
        tag: object = self.tag
        if not isinstance(tag, (str, dict)):
            raise TypeError(f"StructuralTagConstraint.tag must be a dict or JSON text, got "
                            f"{type(tag).__name__} {tag!r}")
        for name in ("strict", "bounded_numbers"):
            value: object = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"StructuralTagConstraint.{name} must be True or False, got "
                                f"{type(value).__name__} {value!r}")

    @property
    def kind(self) -> str:
        return "structural_tag"

    def canonical_text(self) -> str:
        """The tag re-serialised compactly, key order kept (the compile-cache key).

        Raises:
            ValueError: ``tag`` is text that is not JSON, or not a JSON object.
        """
        tag = self.tag
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as e:
                raise ValueError(f"structural_tag is not valid JSON: {e}") from e
        if not isinstance(tag, dict):
            raise ValueError(f"structural_tag must be a JSON object, got {json_type_name(tag)}")
        return json.dumps(tag, separators=(",", ":"), ensure_ascii=False)

    def parsed_tag(self) -> dict[str, Any]:
        """The tag as a dict (parsed from its text when given as text).

        Raises:
            ValueError: as :meth:`canonical_text`.
        """
        if isinstance(self.tag, dict):
            return self.tag
        tag: dict[str, Any] = json.loads(self.canonical_text())
        return tag


CONSTRAINT_TYPES = (JsonSchemaConstraint, JsonObjectConstraint, RegexConstraint, EbnfConstraint,
                    ChoiceConstraint, StructuralTagConstraint)
"""Every grammar constraint type (``SamplingParams.validate`` refuses any other ``grammar``)."""

GrammarConstraint = (JsonSchemaConstraint | JsonObjectConstraint | RegexConstraint
                     | EbnfConstraint | ChoiceConstraint | StructuralTagConstraint)

PARAM_BY_KIND: dict[str, str] = {
    "json_schema": "json_schema",
    "json_object": "response_format",
    "regex": "regex",
    "ebnf": "ebnf",
    "choice": "choice",
    "structural_tag": "structural_tag",
}
"""The field each grammar kind is named by in the engine's errors: the key a CLI ``--batch``
line gives it by (``json_schema``, ``regex``, ``ebnf``, ``choice``, ``structural_tag``;
``json_object``, a fixed
grammar that fails only when the compiler does, keeps OpenAI's ``response_format``).
Grammar errors carry it as their ``param`` (``RequestOutput.error_param`` in the Python API
and a ``--batch`` output record); the server replaces it with the request field the grammar
was read from (``response_format.json_schema``, ``guided_json``, ...; see
:func:`structspec.server.generation.error_for`). A structural tag's error about one place in
the tag names it after the kind's field: ``structural_tag.structures[0].schema``. Here (not in :mod:`structspec.grammar`) so
that the HTTP front end can read it without importing xgrammar."""
