"""Check a grammar constraint without a tokenizer, before any model loads.

The engine compiles a grammar against the model's vocabulary (:mod:`structspec.grammar.backend`),
so a schema xgrammar refuses used to fail only after the model had loaded (``structspec
generate --json-schema`` exited 1 after seconds of loading). The refusals that do not depend
on the vocabulary come from building xgrammar's tokenizer-free ``Grammar`` (the JSON Schema /
regex / EBNF converters) and from the checks the backend runs before compiling (structure,
strict-mode enforceability); :func:`check_grammar` runs exactly those, so the command line can
refuse the grammar up front. The compile in the engine still decides; this only moves the
refusals it would certainly make to before the load.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import xgrammar as xgr

from structspec.constraints import (
    PARAM_BY_KIND,
    EbnfConstraint,
    GrammarConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuralTagConstraint,
)
from structspec.grammar.compile_spec import explained_compile_error
from structspec.grammar.errors import GrammarError
from structspec.grammar.satisfiable import check_servable
from structspec.grammar.schema_grammar import schema_text, strict_refusal
from structspec.grammar.structural_tag_grammar import check_structural_tag, structural_tag_input


def check_grammar(spec: GrammarConstraint | None) -> None:
    """Refuse ``spec`` when the engine's compile would refuse it whatever the model.

    Covers JSON Schemas (text that is not JSON, a structure the engine never serves, keywords
    strict mode cannot enforce, what xgrammar's converter refuses), regexes and EBNF grammars
    (what xgrammar's parsers refuse), and structural tags (their shape, and their JSON Schemas
    as a JSON Schema's; a refusal about one place in the tag names it in ``param``:
    ``structural_tag.structures[0].schema``). ``json_object`` and ``choice`` constraints have nothing
    to check here. Costs a tokenizer-free conversion (milliseconds for ordinary schemas).

    Raises:
        GrammarError: a ``ValueError`` whose message says why (``Failed to compile
            json_schema grammar: invalid JSON Schema at /type: 'foo' is not valid under any of
            the given schemas (compiler: Unsupported type "foo")``; without the ``jsonschema``
            package the compiler's words alone) and whose ``param`` is the grammar kind's
            field (:data:`~structspec.constraints.PARAM_BY_KIND`).
    """
    if spec is None:
        return
    param = PARAM_BY_KIND.get(spec.kind)
    if isinstance(spec, JsonSchemaConstraint):
        try:
            text = schema_text(spec)
        except ValueError as e:
            raise GrammarError(str(e), param=param) from None
        schema = json.loads(text)
        check_servable(schema, param)
        if spec.strict:
            refusal = strict_refusal(schema, spec.canonical_text(), "use best effort "
                                     "(strict false)")
            if refusal is not None:
                raise GrammarError(refusal, param=param)
        if not spec.strict and text != spec.canonical_text():
            # as the engine's compile: when xgrammar refuses the exact rewrite, best effort
            # serves the schema as sent (compile_spec._compile_or_unrewritten)
            try:
                xgr.Grammar.from_json_schema(text, strict_mode=True)
                return
            except Exception:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
                text = spec.canonical_text()
        _convert(spec, param, lambda: xgr.Grammar.from_json_schema(text, strict_mode=True))
    elif isinstance(spec, RegexConstraint):
        _convert(spec, param, lambda: xgr.Grammar.from_regex(spec.pattern))
    elif isinstance(spec, EbnfConstraint):
        _convert(spec, param, lambda: xgr.Grammar.from_ebnf(spec.grammar, root_rule_name="root"))
    elif isinstance(spec, StructuralTagConstraint):
        check_structural_tag(spec)  # the tag's shape; each schema's structure and strict check
        text = structural_tag_input(spec, any_whitespace=False)  # each schema's conversion
        _convert(spec, param, lambda: xgr.Grammar.from_structural_tag(text))


def _convert(spec: GrammarConstraint, param: str | None, build: Callable[[], object]) -> None:
    """Run ``build`` (an xgrammar converter call); its exception becomes a GrammarError
    worded as the engine's compile words it
    (:func:`~structspec.grammar.compile_spec.explained_compile_error`)."""
    try:
        build()
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
        raise GrammarError(f"Failed to compile {spec.kind} grammar: "
                           f"{explained_compile_error(spec, e)}", param=param) from None
