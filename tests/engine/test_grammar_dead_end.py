"""A grammar that reaches a state allowing no token (a property whose ``$ref`` only refers to
itself: xgrammar compiles it, but no value can follow ``"x": ``) ends the request with an
error naming the grammar's field as a request problem, not as the model's non-finite logits
(the server answered that with a 500). CPU, fp32 SmolLM2, greedy: the model writes ``{"x": ``."""

from __future__ import annotations

from structspec import JsonSchemaConstraint, SamplingParams
from structspec.core import INVALID_REQUEST_PARAMETER
from structspec.scheduler.commit import GRAMMAR_DEAD_END_ERROR

SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}}}


def test_a_grammar_dead_end_names_the_grammar(make_llm) -> None:
    llm = make_llm()
    params = SamplingParams(max_tokens=20, temperature=0,
                            grammar=JsonSchemaConstraint(SELF_REF))
    out = llm.generate(["Return a JSON object with x."], params)[0]
    assert out.text.startswith('{"x"'), out.text
    assert out.finish_reason == "abort" and out.error == GRAMMAR_DEAD_END_ERROR
    assert out.error_param == "json_schema"
    assert out.error_code == INVALID_REQUEST_PARAMETER
