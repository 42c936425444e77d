"""The llguidance grammar backend end to end (CPU, fp32 SmolLM2): ``auto`` routes each grammar
to its backend in one mixed batch, speculation stays lossless with llguidance grammars, every
grammar kind runs on llguidance, and each result names the backend that served it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from structspec import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from tests.engine.conftest import PERSON_SCHEMA, PROMPTS

# xgrammar's strict check refuses it (a "date" format: xgrammar does not check the calendar);
# llguidance compiles it exactly
DATED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "string", "format": "date"}},
    "required": ["name", "born"], "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]+( [a-z]+){2,6}\."
GBNF = 'root ::= "Answer: " ("yes" | "no") " because " [a-z ]+ "."'
CHOICES = ("Paris", "London", "Madrid is the answer")
NGRAM = dict(speculative_algorithm="ngram", num_draft_tokens=8)


def _mixed_auto_params(n: int) -> list[SamplingParams]:
    grammars = [JsonSchemaConstraint(PERSON_SCHEMA), JsonSchemaConstraint(DATED_SCHEMA),
                RegexConstraint(REGEX), None]
    return [SamplingParams(max_tokens=32, grammar=grammars[i % 4]) for i in range(n)]


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_auto_mixed_batch_is_lossless_and_names_the_backend(make_llm, n: int) -> None:
    """Half the constrained requests on xgrammar, half on llguidance, in one batch: greedy
    output with n-gram speculation equals output without it, token for token; llguidance's
    JSON validates against its schema. (Each kind once; twice in the slow variant.)"""
    params = _mixed_auto_params(n)
    counts_before = dict(make_llm(grammar_backend="auto", **NGRAM)
                         .engine.scheduler.grammar_backend_counts)
    off = make_llm(grammar_backend="auto").generate(PROMPTS[:n], params)
    on = make_llm(grammar_backend="auto", **NGRAM).generate(PROMPTS[:n], params)
    expected = (["xgrammar", "llguidance", "xgrammar", None] * 2)[:n]
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, i
        assert a.grammar_backend == b.grammar_backend == expected[i], i
    assert sum(o.spec.verify_steps for o in on) > 0
    for o in on[1::4]:
        if o.finish_reason.value == "stop":
            jsonschema.validate(json.loads(o.text), DATED_SCHEMA)
    counts = make_llm(grammar_backend="auto", **NGRAM).engine.scheduler.grammar_backend_counts
    added = {k: counts.get(k, 0) - counts_before.get(k, 0) for k in ("llguidance", "xgrammar")}
    assert added == {"llguidance": n // 4, "xgrammar": n // 2}, added


@pytest.mark.slow  # two more engines (~20 s); the kinds are covered fast in tests/grammar
def test_every_kind_on_llguidance_is_lossless(make_llm) -> None:
    """JSON Schema, json_object, regex, EBNF and choice on llguidance: greedy output with
    n-gram drafts equals output without, token for token, and every finished output is in
    its grammar's language. (Not compared with xgrammar's outputs: llguidance allows only the
    canonical tokenization of a grammar's literal text, e.g. "Answer" but not "A" + "nswer",
    so its masks are subsets of xgrammar's and greedy picks may differ.)"""
    grammars = [JsonSchemaConstraint(PERSON_SCHEMA), JsonObjectConstraint(),
                RegexConstraint(REGEX), EbnfConstraint(GBNF), ChoiceConstraint(CHOICES)]
    params = [SamplingParams(max_tokens=32, grammar=g) for g in grammars]
    prompts = PROMPTS[:5]
    off = make_llm(grammar_backend="llguidance").generate(prompts, params)
    got = make_llm(grammar_backend="llguidance", **NGRAM).generate(prompts, params)
    for a, o, g in zip(off, got, grammars, strict=True):
        assert o.error is None and o.grammar_backend == "llguidance", (g.kind, o.error)
        assert a.token_ids == o.token_ids and a.finish_reason == o.finish_reason, g.kind
        if o.finish_reason.value != "stop":
            continue
        if isinstance(g, JsonSchemaConstraint):
            jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)
        elif isinstance(g, JsonObjectConstraint):
            assert isinstance(json.loads(o.text), dict)
        elif isinstance(g, RegexConstraint):
            assert re.fullmatch(REGEX, o.text), o.text
        elif isinstance(g, EbnfConstraint):
            assert re.fullmatch(r"Answer: (yes|no) because [a-z ]+\.", o.text), o.text
        else:
            assert o.text in CHOICES
    assert sum(o.spec.verify_steps for o in got) > 0


@pytest.mark.slow  # an engine with two worker processes: ~25 s of CPU (suite time budget)
def test_auto_mixed_batch_on_mask_workers_matches_in_process(make_llm) -> None:
    """``auto`` with two mask worker processes: the xgrammar *and* the llguidance requests'
    trees are walked by the workers' mirrors once their grammars arrive (llguidance's as
    grammar text, compiled in the worker), and greedy output equals the spec-off output, token
    for token, with the same backend named per request. (The bitmask equality itself, row for
    row and step by step, is tests/grammar/test_worker_pool.py's, in the fast suite.)"""
    from structspec import LLM
    from tests.engine.conftest import KV_CAPACITY_TOKENS, release_memory

    params = _mixed_auto_params(4)
    off = make_llm(grammar_backend="auto").generate(PROMPTS[:4], params)
    llm = LLM(device="cpu", dtype="float32", quantization="none",
              kv_capacity_tokens=KV_CAPACITY_TOKENS, max_batch_size=32,
              speculative_adaptive="off", grammar_backend="auto", grammar_workers=2, **NGRAM)
    try:
        pool = llm.engine.scheduler.mask_pool
        assert pool is not None and pool.backends == {"xgrammar", "llguidance"}
        on = llm.generate(PROMPTS[:4], params)
        on_again = llm.generate(PROMPTS[:4], params)  # shipped again: the workers dropped them
        # three grammars per batch (two xgrammar, one llguidance) each went to a worker; an
        # xgrammar-only pool would have shipped two
        assert pool.num_builds > 0 and pool.num_shipped >= 6, pool.num_shipped
    finally:
        llm.close()
        del llm
        release_memory()
    for i, (a, b, c) in enumerate(zip(off, on, on_again, strict=True)):
        assert b.error is None and c.error is None, (b.error, c.error)
        assert a.token_ids == b.token_ids == c.token_ids, i
        assert a.grammar_backend == b.grammar_backend == c.grammar_backend, i


@pytest.mark.parametrize(("grammar", "param", "words"), [
    # neither backend enforces 'not' of a const: xgrammar's error, naming the pointer
    (JsonSchemaConstraint({"type": "object", "properties": {"a": {"type": "string", "not": {
        "const": "x"}}}}), "json_schema", "/properties/a: 'not'"),
    (EbnfConstraint('root ::= "a'), "ebnf", "Failed to compile ebnf grammar"),
    (RegexConstraint("(a"), "regex", "Failed to compile regex grammar"),
])
def test_auto_bad_grammar_fails_its_request_naming_the_field(make_llm, grammar, param: str,
                                                             words: str) -> None:
    """Bad input on the ``auto`` path: the request ends with an error naming the field
    (``RequestOutput.error_param``; the server's 400 carries it) and the others go on."""
    llm = make_llm(grammar_backend="auto")
    bad, good = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, grammar=grammar),
                                           SamplingParams(max_tokens=4)])
    assert bad.error is not None and words in bad.error, bad.error
    assert bad.error_param == param and bad.token_ids == []
    assert good.error is None and len(good.token_ids) == 4
    pytest.importorskip("fastapi")
    from structspec.server.generation import error_for
    from structspec.server.ipc import EngineDelta

    http = error_for(EngineDelta(request_id="r", finished=True, finish_reason="abort",
                                 error=bad.error, error_param=bad.error_param, rejected=True))
    assert http.status == 400 and http.param == param
