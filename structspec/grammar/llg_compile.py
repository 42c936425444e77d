"""One grammar constraint -> one llguidance grammar, checked and compiled
(:func:`compile_llguidance`).

The same checks as the xgrammar path (:mod:`structspec.grammar.compile_spec`) where they are
backend neutral (schema structure, satisfiability, regex syntax, the accepts-some-output
check), then llguidance's own compile. JSON Schemas compile **exactly**: llguidance's
``lenient`` option (ignore keywords it does not implement) is on only for ``strict=False``,
and ``coerce_one_of`` (``oneOf`` as ``anyOf``) is never on, so a keyword llguidance cannot
enforce refuses the schema. EBNF is GBNF, converted to llguidance's Lark dialect by
llguidance's own converter (``llguidance.grammar_from("gbnf", ...)``). Structural tags are
refused (:data:`STRUCTURAL_TAG_REFUSAL`: llguidance's ``StructTag`` is not their exact
equivalent); ``auto`` serves them on xgrammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import is_lark_syntax

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.grammar.bitmask import allocate_bitmask
from structspec.grammar.compile_spec import choice_ebnf, with_ebnf_error_context
from structspec.grammar.errors import PARAM_BY_KIND, GrammarError
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher
from structspec.grammar.number_bounds import bound_schema_numbers
from structspec.grammar.satisfiable import check_servable
from structspec.grammar.schema_check import MAX_POINTERS_SHOWN, keyword_pointers
from structspec.grammar.schema_grammar import metaschema_problem, schema_text
from structspec.regex_check import find_regex_problem

COMPACT_SEPARATORS = (", ", ": ")
"""JSON separators with ``any_whitespace=False``: xgrammar's defaults, so that both backends
produce the same JSON text."""


STRUCTURAL_TAG_REFUSAL = (
    "structural_tag grammars are served by xgrammar only: llguidance has no exact equivalent "
    "(its StructTag lets the text after the last tag contain a trigger, turns triggers "
    "written <...> into special tokens, and has none of the other formats); use "
    "--grammar-backend xgrammar or auto (LLM(grammar_backend=...)), which serve it on xgrammar")
"""The refusal of a structural tag under ``--grammar-backend llguidance``."""


def json_options(*, any_whitespace: bool, lenient: bool) -> dict[str, Any]:
    """llguidance ``JsonCompileOptions`` matching the xgrammar path's JSON formatting."""
    if any_whitespace:
        return {"whitespace_flexible": True, "lenient": lenient, "coerce_one_of": False}
    return {"whitespace_flexible": False, "item_separator": COMPACT_SEPARATORS[0],
            "key_separator": COMPACT_SEPARATORS[1], "lenient": lenient,
            "coerce_one_of": False}


def llguidance_grammar(spec: GrammarConstraint, *, any_whitespace: bool) -> str:
    """The llguidance grammar text of ``spec`` (not validated yet).

    Raises:
        GrammarError: an empty choice list / empty choice, a GBNF grammar llguidance's
            converter cannot read, or an unknown kind; naming the field.
    """
    param = PARAM_BY_KIND.get(spec.kind)
    if isinstance(spec, JsonSchemaConstraint):
        text = schema_text(spec)
        if spec.bounded_numbers:  # the loop guard (values of any type stay unbounded here)
            text = json.dumps(bound_schema_numbers(json.loads(text)), ensure_ascii=False)
        return llguidance.LLMatcher.grammar_from_json_schema(
            text,
            overrides=json_options(any_whitespace=any_whitespace,  # type: ignore[arg-type]
                                   lenient=not spec.strict))
    if isinstance(spec, JsonObjectConstraint):
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}',
            overrides=json_options(any_whitespace=any_whitespace,  # type: ignore[arg-type]
                                   lenient=False))
    if isinstance(spec, RegexConstraint):
        return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
    if isinstance(spec, EbnfConstraint):
        try:
            return llguidance.grammar_from("gbnf", spec.grammar)
        except ValueError as e:
            raise GrammarError("Failed to compile ebnf grammar (llguidance): "
                               + gbnf_error_message(e, spec.grammar), param=param) from e
    if isinstance(spec, ChoiceConstraint):
        choice_ebnf(spec.choices)  # the same refusal of empty lists/choices as xgrammar's
        return llguidance.grammar_from("choice", json.dumps(list(spec.choices)))
    if isinstance(spec, StructuralTagConstraint):
        raise GrammarError(STRUCTURAL_TAG_REFUSAL, param=param)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}", param=param)


def gbnf_error_message(e: ValueError, grammar: str) -> str:
    """llguidance's GBNF reader's error for ``grammar``, positioned as xgrammar's: ``...:
    Expected ')' at line 2, column 1 (at the end of the grammar)``, then the grammar line with
    a caret under the column (:func:`~structspec.grammar.compile_spec.with_ebnf_error_context`;
    the column counted in characters, as for xgrammar's errors).

    The reader's own text names the line and quotes up to 20 characters either side of the
    place (``at line 2, 'root ::= "a" (\\n' ^ ''``); the exact offset comes from the error
    it raised (the ``ValueError``'s context: ``GbnfToLarkError.pos``). An error without a
    position (``Rule 'c' not found``), or one whose shape this does not know (another
    llguidance version), is returned as llguidance wrote it.
    """
    message = str(e)
    where = getattr(e.__context__, "pos", None)
    offset = getattr(where, "pos", None)
    if (not isinstance(offset, int) or getattr(where, "text", None) != grammar
            or not 0 <= offset <= len(grammar) or not message.endswith(f" at {where}")):
        return message
    line = grammar.count("\n", 0, offset) + 1
    line_start = grammar.rfind("\n", 0, offset) + 1
    column = len(grammar[line_start:offset].encode()) + 1
    message = message[: -len(f" at {where}")] + f" at line {line}, column {column}"
    return with_ebnf_error_context(message, grammar)


def check_grammar_llguidance(spec: GrammarConstraint | None) -> None:
    """Refuse ``spec`` when llguidance would refuse it whatever the model: the checks
    :func:`compile_llguidance` runs before compiling, then llguidance's tokenizer-free grammar
    validation (``LLMatcher.validate_grammar``). Lets the command line refuse a grammar for
    ``--grammar-backend llguidance`` before the model loads; the compile still decides.

    Raises:
        GrammarError: naming the grammar kind's field, with llguidance's first error line.
    """
    if spec is None:
        return
    param = PARAM_BY_KIND.get(spec.kind)
    _check_before_compile(spec, param)
    error = llguidance.LLMatcher.validate_grammar(
        llguidance_grammar(spec, any_whitespace=False))
    if error:
        raise GrammarError(f"Failed to compile {spec.kind} grammar (llguidance): "
                           f"{_compile_message(spec, error)}", param=param)


def compile_llguidance(tokenizer: llguidance.LLTokenizer, spec: GrammarConstraint, *,
                       vocab_size: int, any_whitespace: bool,
                       stop_token_ids: list[int]) -> LlgCompiled:
    """Check and compile ``spec`` for ``tokenizer`` (module docstring).

    Runs in a compile thread (llguidance drops the GIL while it builds the grammar; its
    lexer and parser limits bound the work).

    Raises:
        GrammarError: an invalid or unservable spec, or llguidance's compile error
            (``"Failed to compile <kind> grammar (llguidance): <message>"``), naming the field.
    """
    kind = spec.kind
    param = PARAM_BY_KIND.get(kind)
    _check_before_compile(spec, param)
    grammar = llguidance_grammar(spec, any_whitespace=any_whitespace)
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if template.is_error():
        message = _compile_message(spec, template.get_error())
        if isinstance(spec, JsonSchemaConstraint):
            problem = metaschema_problem(spec)
            if problem is not None:
                message = f"{problem} (compiler: {message})"
        raise GrammarError(f"Failed to compile {kind} grammar (llguidance): {message}",
                           param=param)
    compiled = LlgCompiled(template=template, vocab_size=vocab_size, kind=kind, grammar=grammar)
    bitmask = allocate_bitmask(1, vocab_size, pin=False)
    LlgMatcher(compiled, stop_token_ids=stop_token_ids).fill_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError("the grammar accepts no output at all (for a JSON Schema: a "
                           "$ref cycle with no way out, or contradictory constraints)",
                           param=param)
    return compiled


def _check_before_compile(spec: GrammarConstraint, param: str | None) -> None:
    """The checks that need no compile: schema text and structure, regex usability.

    Raises:
        GrammarError: naming ``param``.
    """
    if isinstance(spec, JsonSchemaConstraint):
        try:
            schema = json.loads(schema_text(spec))
        except ValueError as e:
            raise GrammarError(str(e), param=param) from e
        check_servable(schema, param)
    elif isinstance(spec, RegexConstraint):
        problem = find_regex_problem(spec.pattern)
        if problem is not None:
            raise GrammarError(f"regex is not a usable regex: {problem}", param=param)


def _compile_message(spec: GrammarConstraint, error: str) -> str:
    """llguidance's compile error for ``spec`` (:func:`_first_line`), without the position
    in its Lark translation that it starts with for a regex or a GBNF grammar (``at 3(8):
    range end must be >= start``): line 3 of ``%llguidance {}`` and the renamed rules, a text
    the client never wrote (the xgrammar path drops its internal position of a regex too).
    A grammar given in Lark syntax, which llguidance reads as it is, keeps its position."""
    message = _first_line(error)
    if isinstance(spec, RegexConstraint) or (isinstance(spec, EbnfConstraint)
                                             and not is_lark_syntax(spec.grammar)):
        message = _LARK_POSITION.sub("", message)
    if isinstance(spec, JsonSchemaConstraint):
        message = _with_keyword_pointers(spec, message)
    return message


_LARK_POSITION = re.compile(r"^at \d+\(\d+\): ")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")


def _with_keyword_pointers(spec: JsonSchemaConstraint, message: str) -> str:
    """llguidance names the keywords it does not implement (``Unimplemented keys:
    ["uniqueItems"]``) but not where they are: add their JSON pointers in the client's schema
    (``(at /properties/tags/uniqueItems)``), as the xgrammar path's strict refusal names them.
    Left as it is when the message has no such list or the keys are not found."""
    found = _UNIMPLEMENTED.search(message)
    if found is None:
        return message
    try:
        keys = json.loads(found.group(1))
        schema = json.loads(spec.canonical_text())
    except ValueError:
        return message
    if not isinstance(keys, list):
        return message
    pointers = keyword_pointers(schema, [k for k in keys if isinstance(k, str)])
    if not pointers:
        return message
    more = len(pointers) - MAX_POINTERS_SHOWN
    return (f"{message} (at {', '.join(pointers[:MAX_POINTERS_SHOWN])}"
            + (f" and {more} more" if more > 0 else "") + ")")


def _first_line(message: str) -> str:
    """The reason of an llguidance error on one line: its lines up to the parser state dump
    (``<state>``), without the source excerpt and caret lines (``1 | ...``, ``^``)."""
    kept = []
    for line in message.strip().splitlines():
        line = line.strip()
        if line.startswith("<state>"):
            break
        if not line or set(line) <= {"^", "~", "-"} or _EXCERPT.match(line):
            continue
        kept.append(line)
    return " ".join(kept)[:500] or "unknown error"


_EXCERPT = re.compile(r"^\d+ \|")
