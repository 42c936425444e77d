"""Loop guard for JSON numbers in xgrammar's *any-value* rules.

xgrammar's JSON Schema converter writes values of any type (``json_object``, ``{}``,
``true``, an object without ``properties``) with a fixed set of ``basic_*`` rules whose numbers
have no length limit. :func:`bound_any_numbers` rewrites those rules in the converted grammar's
EBNF text and parses it back:

- ``basic_integer``: at most 18 digits (``|n| < 10**18``);
- ``basic_number``: at most 16 integer digits, 6 fraction digits and 2 exponent digits.

Every other rule is kept as converted (the EBNF round trip of xgrammar 0.2.8 reproduces each of
the MaskBench grammars' text exactly). The typed ``integer`` / ``number`` subschemas are
bounded in the schema instead (:mod:`structspec.grammar.number_bounds`).
"""

from __future__ import annotations

import xgrammar as xgr

ANY_NUMBER_RULES: dict[str, str] = {
    'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))':
        'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]{0, 17}))',
    'basic_number_2 ::= (("0") | ([1-9] [0-9]*))':
        'basic_number_2 ::= (("0") | ([1-9] [0-9]{0, 15}))',
    'basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))':
        'basic_number_3 ::= ("" | ("." basic_number_digits{1, 6}))',
    'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))':
        'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, 2}))',
}
"""xgrammar 0.2.8's unbounded number rules (exact EBNF lines) -> their bounded forms."""


def bound_any_numbers(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` with its any-value number rules bounded (module doc); ``grammar`` itself
    when it has none of them.

    Raises:
        RuntimeError / ValueError: xgrammar cannot parse the rewritten text (not expected:
            the rules are replaced line for line by rules of the same names).
    """
    lines = str(grammar).split("\n")
    changed = False
    for i, line in enumerate(lines):
        bounded = ANY_NUMBER_RULES.get(line)
        if bounded is not None:
            lines[i] = bounded
            changed = True
    if not changed:
        return grammar
    return xgr.Grammar.from_ebnf("\n".join(lines), root_rule_name="root")


def bounded_json_schema_grammar(schema_text: str, *, any_whitespace: bool) -> xgr.Grammar:
    """xgrammar's grammar of a JSON Schema (strict mode, as the engine compiles it) with the
    any-value number rules bounded."""
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace,
                                           strict_mode=True)
    return bound_any_numbers(grammar)
