"""One grammar constraint -> one xgrammar ``CompiledGrammar``, with every check before it.

:func:`compile_checked` is the whole compile of a request's grammar: structure, regex syntax,
satisfiability (a schema no finite value satisfies), strict-mode enforceability (of each JSON
Schema in a structural tag too: :mod:`structspec.grammar.structural_tag_grammar`), the xgrammar
compile, and the check that the compiled grammar accepts some output. It runs in a compile
worker process (:mod:`structspec.grammar.compile_worker`, where a runaway compile can be
killed); :func:`compile_only` rebuilds an accepted grammar in the engine process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import xgrammar as xgr

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
from structspec.grammar.errors import PARAM_BY_KIND, GrammarError
from structspec.grammar.matcher import Matcher
from structspec.grammar.satisfiable import check_servable
from structspec.grammar.schema_grammar import (
    check_enforceable,
    compiler_message,
    json_schema_grammar,
    metaschema_problem,
    or_unrewritten,
    schema_text,
)
from structspec.grammar.structural_tag_grammar import check_structural_tag, structural_tag_input
from structspec.grammar.xgr_numbers import bounded_json_schema_grammar
from structspec.regex_check import find_regex_problem


def compile_only(compiler: xgr.GrammarCompiler, spec: GrammarConstraint, *,
                 any_whitespace: bool) -> xgr.CompiledGrammar:
    """The xgrammar compile of ``spec`` alone (no checks): for a grammar that already passed
    :func:`compile_checked` in a worker.

    Raises:
        GrammarError: the compiler failed (it did not in the worker: an xgrammar fault).
    """
    try:
        return _compile_or_unrewritten(compiler, spec, any_whitespace=any_whitespace)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        raise GrammarError(f"Failed to compile {spec.kind} grammar: {compiler_message(e)}",
                           param=PARAM_BY_KIND.get(spec.kind)) from e


def compile_checked(compiler: xgr.GrammarCompiler, spec: GrammarConstraint, *,
                    any_whitespace: bool, vocab_size: int,
                    stop_token_ids: Sequence[int]) -> xgr.CompiledGrammar:
    """Check and compile ``spec`` (module docstring); every failure is a
    :class:`GrammarError` naming the grammar's field.

    Args:
        compiler: an xgrammar compiler for the served tokenizer.
        spec: the grammar constraint.
        any_whitespace: JSON Schema whitespace (``False``: xgrammar's compact separators).
        vocab_size: the logits width (the accepts-output check's bitmask).
        stop_token_ids: the stop ids a finished grammar allows.

    Raises:
        GrammarError: an invalid or unservable spec (its reason), or a compile failure
            (``"Failed to compile <kind> grammar: <compiler message>"``).
    """
    kind = spec.kind
    param = PARAM_BY_KIND.get(kind)
    try:
        if isinstance(spec, JsonSchemaConstraint):
            schema = json.loads(schema_text(spec))
            check_servable(schema, param)
            if spec.strict:
                check_enforceable(schema, param, spec.canonical_text())
        elif isinstance(spec, RegexConstraint):
            problem = find_regex_problem(spec.pattern)
            if problem is not None:
                raise GrammarError(f"regex is not a usable regex: {problem}", param=param)
        elif isinstance(spec, StructuralTagConstraint):
            check_structural_tag(spec)
        compiled = _compile_or_unrewritten(compiler, spec, any_whitespace=any_whitespace)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        raise GrammarError(f"Failed to compile {kind} grammar: {explained_compile_error(spec, e)}",
                           param=param) from e
    if isinstance(spec, (JsonSchemaConstraint, RegexConstraint, EbnfConstraint,
                         StructuralTagConstraint)):
        _check_accepts_output(compiled, param, vocab_size=vocab_size,
                              stop_token_ids=stop_token_ids)
    return compiled


def _compile_or_unrewritten(compiler: xgr.GrammarCompiler, spec: GrammarConstraint, *,
                            any_whitespace: bool) -> xgr.CompiledGrammar:
    """:func:`_xgrammar_compile`; a JSON Schema whose exact rewrite xgrammar does not take is
    served as sent (:func:`~structspec.grammar.schema_grammar.or_unrewritten`): refused in
    strict mode naming the original's unenforceable keywords, weakened in best effort
    (reported by ``schema_valid``); ``auto`` goes on to llguidance either way.

    Raises:
        GrammarError: the original's unenforceable keywords (strict mode).
        Exception: xgrammar's own error, when the schema as sent fails too.
    """
    if not isinstance(spec, JsonSchemaConstraint):
        return _xgrammar_compile(compiler, spec, any_whitespace=any_whitespace)
    return or_unrewritten(
        spec, lambda rewrite: _xgrammar_compile(compiler, spec, any_whitespace=any_whitespace,
                                                rewrite=rewrite),
        param=PARAM_BY_KIND.get(spec.kind))


def _xgrammar_compile(compiler: xgr.GrammarCompiler, spec: GrammarConstraint, *,
                      any_whitespace: bool, rewrite: bool = True) -> xgr.CompiledGrammar:
    if isinstance(spec, JsonSchemaConstraint):
        if spec.bounded_numbers:  # the loop guard: bounded integers and numbers
            return compiler.compile_grammar(
                json_schema_grammar(spec, any_whitespace=any_whitespace, rewrite=rewrite))
        text = schema_text(spec) if rewrite else spec.canonical_text()
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace,
                                            strict_mode=True)
    if isinstance(spec, JsonObjectConstraint):
        if spec.bounded_numbers:
            return compiler.compile_grammar(bounded_json_schema_grammar(
                '{"type": "object"}', any_whitespace=any_whitespace))
        return compiler.compile_json_schema('{"type": "object"}',
                                            any_whitespace=any_whitespace, strict_mode=True)
    if isinstance(spec, RegexConstraint):
        return compiler.compile_regex(spec.pattern)
    if isinstance(spec, EbnfConstraint):
        return compiler.compile_grammar(spec.grammar, root_rule_name="root")
    if isinstance(spec, ChoiceConstraint):
        return compiler.compile_grammar(choice_ebnf(spec.choices))
    if isinstance(spec, StructuralTagConstraint):
        return compiler.compile_structural_tag(
            structural_tag_input(spec, any_whitespace=any_whitespace))
    raise GrammarError(f"unknown grammar kind {spec.kind!r}", param=PARAM_BY_KIND.get(spec.kind))


def _check_accepts_output(compiled: xgr.CompiledGrammar, param: str | None, *,
                          vocab_size: int, stop_token_ids: Sequence[int]) -> None:
    """Refuse a grammar whose start state allows no token at all (not even a stop token): a
    grammar whose language is empty, e.g. a schema whose ``$ref`` cycle has no base case.
    Such a request would otherwise fail at its first token with a "grammar rejected token"
    error that looks like an engine fault.

    Raises:
        GrammarError: the grammar accepts no output.
    """
    bitmask = allocate_bitmask(1, vocab_size, pin=False)
    Matcher(compiled, stop_token_ids=stop_token_ids).fill_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError("the grammar accepts no output at all (for a JSON Schema: a "
                           "$ref cycle with no way out, or contradictory constraints)",
                           param=param)


def choice_ebnf(choices: Sequence[str]) -> str:
    """A GBNF grammar whose sentences are exactly ``choices`` (``root ::= "a" | "b"``).

    Raises:
        GrammarError: when ``choices`` is empty or contains an empty string.
    """
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings",
                           param="choice")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def explained_compile_error(spec: GrammarConstraint, e: BaseException) -> str:
    """xgrammar's words for a grammar it refused (:func:`compiler_message`), made to say where:
    a JSON Schema's metaschema violation (JSON pointer) before them, when there is one
    (xgrammar names neither the place nor the rule: ``Unsupported type "objectz"``); an EBNF
    grammar's line with a caret after them; a regex's error without xgrammar's internal EBNF
    position. Used by the engine's compile and by the command line's precheck alike."""
    message = compiler_message(e)
    if isinstance(spec, JsonSchemaConstraint):
        problem = metaschema_problem(spec)
        if problem is not None:
            message = f"{problem} (compiler: {message})"
    elif isinstance(spec, EbnfConstraint):
        if isinstance(e, UnicodeDecodeError):
            # xgrammar's lexer quotes the first byte of a stray non-ASCII character, which
            # cuts it in half: its message is not UTF-8 and arrives as a decode error
            message = _stray_character_message(spec.grammar) or message
        message = with_ebnf_error_context(message, spec.grammar)
    elif isinstance(spec, RegexConstraint):
        message = _regex_compiler_message(message)
    return message


def with_backend_note(message: str, backend: str, note: str) -> str:
    """``message`` (one backend's refusal of a grammar) followed by what ``backend`` said of
    it: ``"... (xgrammar: ...)"`` when both are one line; otherwise the note on lines of its
    own after ``message``, ``"...\nxgrammar: ..."``. A closing parenthesis after a caret
    block (:func:`_ebnf_error_context`) used to land at the end of the caret line, and a
    block inside parentheses no longer lined up with the line above it.

    Args:
        message: the error reported first (its caret block, if any, is left as it is).
        backend: the other backend's name (``"xgrammar"``).
        note: its error message or what happened to it (``"ran out of its compile time"``).
    """
    if "\n" in message or "\n" in note:
        return f"{message}\n{backend}: {note}"
    return f"{message} ({backend}: {note})"


_EBNF_POSITION = re.compile(r"^EBNF parser error at line \d+, column \d+: ")


def _regex_compiler_message(message: str) -> str:
    """xgrammar's error for a regex without its EBNF position (``EBNF parser error at line 1,
    column 11: Invalid character class: ...``): xgrammar parses a regex as the body of an EBNF
    rule of its own, so the line and column name a text the client never wrote."""
    return _EBNF_POSITION.sub("", message)


_LINE_COLUMN = re.compile(r"at line (\d+), column (\d+)")


def _stray_character_message(grammar: str) -> str | None:
    """An EBNF lexer error for the first non-ASCII character outside a string literal, a
    character class and a comment (where xgrammar's lexer takes only ASCII), worded and
    positioned as xgrammar's own (line, column in UTF-8 bytes); None when there is none."""
    state = ""  # '"' in a string literal, "[" in a character class, "#" in a comment
    escaped = False
    line, column = 1, 1
    for ch in grammar:
        if state == "#":
            state = "" if ch == "\n" else state
        elif state:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == ('"' if state == '"' else "]"):
                state = ""
        elif ch in '"[#':
            state = ch
        elif ord(ch) > 127:
            return (f"EBNF lexer error at line {line}, column {column}: Unexpected character: "
                    f"{ch!r} (U+{ord(ch):04X}; outside a string literal or a character class "
                    "the grammar must be ASCII)")
        if ch == "\n":
            line, column = line + 1, 1
        else:
            column += len(ch.encode())
    return None


def with_ebnf_error_context(message: str, grammar: str) -> str:
    """An EBNF parser error whose ``at line L, column C`` counts UTF-8 bytes (xgrammar's, and
    the GBNF path's, which positions as xgrammar does) as a person reads it: the column in
    characters, then :func:`_ebnf_error_context` (the line and its caret)."""
    context = _ebnf_error_context(message, grammar)
    match = _LINE_COLUMN.search(message)
    if match is not None:
        line_no, column = int(match[1]), int(match[2])
        lines = grammar.split("\n")
        if 1 <= line_no <= len(lines) and column >= 1:
            chars = _char_column(lines[line_no - 1], column)
            message = f"{message[: match.start(2)]}{chars}{message[match.end(2):]}"
    return message + context


def _char_column(line: str, byte_column: int) -> int:
    """The 1-based character column of a 1-based UTF-8 byte column of ``line`` (a column past
    the line's end stays as far past it)."""
    line_bytes = line.encode()
    return len(line_bytes[: byte_column - 1].decode(errors="ignore")) + 1 + max(
        0, byte_column - 1 - len(line_bytes))


def _ebnf_error_context(message: str, grammar: str) -> str:
    """The grammar line an xgrammar EBNF parser error points at, as text to append to it.

    xgrammar ends ``Expect element, but got `` with the offending character, which is nothing
    at the end of a line or of the grammar (the message looked cut short); this names it and
    shows the line with a caret under the column (at the end of the grammar: the last line
    with text, the caret after it):
    ``" (end of the grammar)\n  line 2: b ::=\n                ^"``. Empty when the message
    has no line and column, or they are outside ``grammar``.
    """
    match = _LINE_COLUMN.search(message)
    if match is None:
        return ""
    line_no, column = int(match[1]), int(match[2])
    lines = grammar.split("\n")
    if not 1 <= line_no <= len(lines) or column < 1:
        return ""
    # xgrammar counts bytes of UTF-8; the caret goes under characters
    column = _char_column(lines[line_no - 1], column)
    rest = "\n".join([lines[line_no - 1][column - 1:], *lines[line_no:]])
    cut = message.endswith("but got")  # xgrammar printed no character: an end
    if not rest.strip():  # nothing but blanks from here on: the grammar ended too early
        last = max((i for i, ln in enumerate(lines, 1) if ln.strip()), default=1)
        if last == line_no:  # the reported line: the caret stays at the reported column
            text = lines[line_no - 1]
        else:  # blank lines after it: point after the last text instead
            line_no, text = last, lines[last - 1].rstrip()
            column = len(text) + 1
        got = " (end of the grammar)" if cut else " (at the end of the grammar)"
    else:
        text = lines[line_no - 1]
        got = " (end of line)" if cut else ""
    head = f"  line {line_no}: "
    # the caret line copies the tabs before the column (a space for anything else), so the
    # caret stays under its character however wide the terminal draws a tab
    pad = "".join("\t" if ch == "\t" else " " for ch in text[: column - 1])
    pad += " " * (column - 1 - len(pad))  # a column past the line's end (trailing blanks)
    return f"{got}\n{head}{text}\n{' ' * len(head)}{pad}^"
