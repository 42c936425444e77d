"""Up-front grammar size limits and the compile-lane estimate (no xgrammar, no compile).

A grammar over one of :class:`~structspec.config.GrammarConfig`'s ``max_*`` limits is refused
before it is compiled, with code ``grammar_too_complex``: xgrammar's compile time and memory
grow with these counts (a 10,000-property object ran past 30 s and grew to 6 GB), and a clear
400 naming the count beats a compile killed at its time limit. The limits sit far above every
MaskBench schema (``tests/grammar/test_compile_limits.py`` checks all of them).

:func:`is_small` sorts the rest into the small-grammar compile lane or the general one
(:mod:`structspec.grammar.compile_pool`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from structspec.config import GrammarConfig
from structspec.constraints import (
    ChoiceConstraint,
    GrammarConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.grammar.errors import GRAMMAR_TOO_COMPLEX, PARAM_BY_KIND, GrammarError
from structspec.regex_check import find_regex_problem
from structspec.schema_structure import escape_pointer_token
from structspec.structural_tag import StructuralTagError, read_structural_tag

# {n}, {n,} and {n,m} (unescaped); the bounds are what xgrammar expands
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def grammar_text(spec: GrammarConstraint) -> str:
    """The text the limits measure: the canonical text (schema JSON, pattern, grammar, the
    choices as a JSON list).

    Raises:
        ValueError: a schema that is not JSON / not an object or boolean.
    """
    return spec.canonical_text()


def find_limit_problem(spec: GrammarConstraint, text: str,
                       config: GrammarConfig) -> str | None:
    """The first up-front limit ``spec`` is over, as a sentence naming the count, the limit
    and the place, or None.

    Args:
        spec: the grammar constraint.
        text: its canonical text (:func:`grammar_text`).
        config: the limits (``max_grammar_bytes``, ``max_schema_properties``,
            ``max_schema_enum_values``, ``max_schema_subschemas``, ``max_regex_repeat``).
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > config.max_grammar_bytes:
        return (f"the {spec.kind} grammar is {size} bytes, over the limit of "
                f"{config.max_grammar_bytes} bytes")
    if isinstance(spec, RegexConstraint):
        return _repeat_problem(spec.pattern, "the regex", config)
    if isinstance(spec, JsonSchemaConstraint):
        return _schema_problem(json.loads(text), config)
    if isinstance(spec, ChoiceConstraint):
        return None  # compile cost is linear in the text: the byte limit covers it
    if isinstance(spec, StructuralTagConstraint):
        return _structural_tag_problem(json.loads(text), config)
    return None


def upfront_error(spec: GrammarConstraint, text: str,
                  config: GrammarConfig) -> GrammarError | None:
    """The error every backend gives a grammar before compiling it, or None: a regex that is
    not one (``\\q``, ``[^]``), or a grammar over a limit of :func:`find_limit_problem`
    (code ``grammar_too_complex``). ``text``: the spec's canonical text. Cheap (no compile),
    so it is not cached: a refused 4 MB text must not hold cache memory."""
    param = PARAM_BY_KIND.get(spec.kind)
    if isinstance(spec, RegexConstraint):
        problem = find_regex_problem(spec.pattern)
        if problem is not None:
            return GrammarError(f"regex is not a usable regex: {problem}", param=param)
    try:
        problem = find_limit_problem(spec, text, config)
    except (ValueError, TypeError) as e:
        return GrammarError(str(e), param=param)
    if problem is not None:
        return GrammarError(f"grammar too complex to compile: {problem}", param=param,
                            code=GRAMMAR_TOO_COMPLEX)
    return None


def is_small(text: str, config: GrammarConfig) -> bool:
    """Whether a grammar goes to the small-grammar compile lane: its canonical text is at
    most ``config.small_grammar_bytes`` long (a cost estimate; a small grammar that compiles
    slowly anyway moves to the general lane after ``small_lane_slice_s``)."""
    return len(text) <= config.small_grammar_bytes


def _structural_tag_problem(tag: object, config: GrammarConfig) -> str | None:
    """The limits of each JSON Schema and regex in a structural tag, named by its place (a tag
    the reader refuses is left to the compile, which names the place of its problem)."""
    try:
        read = read_structural_tag(tag)
    except StructuralTagError:
        return None
    for site in read.schemas:
        problem = _schema_problem(site.schema, config)
        if problem is not None:
            return f"the JSON Schema at {site.where}: {problem}"
    for where, pattern in read.patterns:
        problem = _repeat_problem(pattern, where, config)
        if problem is not None:
            return problem
    return None


def _repeat_problem(pattern: str, where: str, config: GrammarConfig) -> str | None:
    for m in _REPEAT.finditer(pattern):
        bound = max(int(m.group(1)), int(m.group(2) or 0))
        if bound > config.max_regex_repeat:
            return (f"{where} repeats {bound} times ('{m.group(0)}' at position {m.start()}), "
                    f"over the limit of {config.max_regex_repeat}")
    return None


def _schema_problem(schema: Any, config: GrammarConfig) -> str | None:
    """Walk every dict of the schema (iteratively; instance data under ``enum``/``const``/
    ``default``/``examples`` is not walked)."""
    subschemas = 0
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, list):
            stack.extend((child, f"{pointer}/{i}") for i, child in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        subschemas += 1
        if subschemas > config.max_schema_subschemas:
            return (f"the schema has more than {config.max_schema_subschemas} JSON objects "
                    "(subschemas and keyword maps; the limit)")
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > config.max_schema_properties:
            return (f"{pointer or '/'}: 'properties' has {len(props)} entries, over the limit "
                    f"of {config.max_schema_properties}")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > config.max_schema_enum_values:
            return (f"{pointer or '/'}: 'enum' has {len(enum)} values, over the limit of "
                    f"{config.max_schema_enum_values}")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = _repeat_problem(pattern, f"{pointer}/pattern", config)
            if problem is not None:
                return problem
        for key, child in node.items():
            if key not in _DATA_KEYWORDS and isinstance(child, (dict, list)):
                stack.append((child, f"{pointer}/{escape_pointer_token(str(key))}"))
    return None
