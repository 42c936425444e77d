"""GrammarBackend: spec kinds, error reporting, timeout, cache (failures, dedupe, LRU)."""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

import pytest
import xgrammar as xgr

from structspec.config import GrammarConfig
from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from structspec.grammar import GrammarBackend, GrammarError

from .conftest import STOP_ID


def _accepts(backend: GrammarBackend, cg: xgr.CompiledGrammar, text: str) -> bool:
    m = backend.create_matcher(cg)
    return m.xgr_matcher.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("spec, param, fragment", [
    (JsonSchemaConstraint("{not json"), "json_schema", "not valid JSON"),
    (JsonSchemaConstraint("[1, 2]"), "json_schema", "must be a JSON object"),
    (JsonSchemaConstraint({"type": "object", "minProperties": 1}), "json_schema",
     "Failed to compile json_schema grammar: minProperties"),
    # xgrammar's words alone name no place; the metaschema check adds the JSON pointer
    (JsonSchemaConstraint({"type": "objectz"}), "json_schema",
     "invalid JSON Schema at /type: 'objectz' is not valid"),
    (JsonSchemaConstraint({"type": "object", "properties": {"a~b/c": {"type": "string",
                                                              "minLength": -3}}}),
     "json_schema",
     "invalid JSON Schema at /properties/a~0b~1c/minLength: -3 is less than the minimum of 0"),
    # an error inside a list: the whole pointer, not the list index alone
    (JsonSchemaConstraint({"type": ["string", 5]}), "json_schema",
     "invalid JSON Schema at /type/1: 5 is not one of"),
    (RegexConstraint("(abc"), "regex", "Failed to compile regex grammar"),
    (RegexConstraint("[z-a]"), "regex", "Failed to compile regex grammar: Invalid character"),
    (EbnfConstraint('start ::= "a"'), "ebnf", "Failed to compile ebnf grammar"),
    # the parser's position shown as the CLI's precheck shows it ("but got" named nothing)
    (EbnfConstraint("root ::= ("), "ebnf",
     "but got (end of the grammar)\n  line 1: root ::= (\n" + " " * 20 + "^"),
    # non-ASCII text before the error: xgrammar's column counts bytes (24 here); the message
    # and the caret count characters
    (EbnfConstraint('root ::= "h\u00e9llo\U0001F600" @ "x"'), "ebnf",
     'line 1, column 19: Unexpected character: @\n  line 1: root ::= "h\u00e9llo\U0001F600" @ '
     '"x"\n' + " " * 28 + "^"),
    # a trailing blank on the reported line: the caret under the column the parser named
    (EbnfConstraint('root ::= "a" b\nb ::= '), "ebnf",
     "line 2, column 7: Expect element, but got (end of the grammar)\n  line 2: b ::= \n"
     + " " * 16 + "^"),
    # a stray non-ASCII character: xgrammar's own message cut it in half (not UTF-8); named,
    # and placed, also after non-ASCII text inside a string, a class and a comment
    (EbnfConstraint('root ::= "a" \u00e9'), "ebnf",
     "line 1, column 14: Unexpected character: '\u00e9' (U+00E9; outside a string literal or "
     "a character class the grammar must be ASCII)\n  line 1: root ::= \"a\" \u00e9\n"
     + " " * 23 + "^"),
    (EbnfConstraint('root ::= [\u00e9\\]] "\u00e9" # \u00e9\nb ::= "x" \u2713'), "ebnf",
     "line 2, column 11: Unexpected character: '\u2713' (U+2713;"),
    # a tab before the column: the caret line copies it, so the caret stays under the column
    (EbnfConstraint('root ::=\t"a" @'), "ebnf",
     'line 1: root ::=\t"a" @\n' + " " * 10 + " " * 8 + "\t" + " " * 4 + "^"),
    (ChoiceConstraint(()), "choice", "non-empty list"),
    (ChoiceConstraint(("a", "")), "choice", "non-empty list"),
    # refused in every mode, before xgrammar (which would ignore them) and before any
    # output check could try to fetch them
    (JsonSchemaConstraint({"properties": {"a": {"$ref": "http://127.0.0.1:9/s.json"}}},
                    strict=False),
     "json_schema",
     "/properties/a/$ref: $ref 'http://127.0.0.1:9/s.json' is not a local reference"),
    (JsonSchemaConstraint({"$ref": "#/$defs/missing"}), "json_schema",
     "/$ref: $ref '#/$defs/missing' points to nothing"),
    # a $ref cycle with no way out: compiles in xgrammar, but no output can satisfy it (the
    # request used to die at its first token with "grammar rejected token")
    (JsonSchemaConstraint({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                    strict=False),
     "json_schema", "accepts no finite JSON value: /$defs/a: a required "
     "value refers back to /$defs/a"),
])
def test_errors_name_the_field(backend: GrammarBackend, spec: Any, param: str,
                               fragment: str) -> None:
    with pytest.raises(GrammarError) as info:
        backend.compile(spec)
    assert info.value.param == param and fragment in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.param == param and str(again) == str(info.value)


def test_strict_rejection_names_keyword_and_pointer(backend: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    with pytest.raises(GrammarError, match="/properties/n: 'not'"):
        backend.compile(JsonSchemaConstraint(schema, strict=True))
    backend.compile(JsonSchemaConstraint(schema, strict=False))  # best effort compiles


def test_cached_failure_is_fast(backend: GrammarBackend) -> None:
    spec = RegexConstraint("[unclosed")
    with pytest.raises(GrammarError) as first:
        backend.compile(spec)
    t0 = time.perf_counter()
    fut = backend.submit(spec)
    assert fut.done()
    with pytest.raises(GrammarError) as second:
        fut.result()
    assert time.perf_counter() - t0 < 0.01 and str(second.value) == str(first.value)


def test_kinds_accept_what_they_should(backend: GrammarBackend) -> None:
    obj = backend.compile(JsonObjectConstraint())
    assert _accepts(backend, obj, '{"a": [1, {"b": null}]}') and _accepts(backend, obj, "{}")
    assert not _accepts(backend, obj, "[1]") and not _accepts(backend, obj, '"s"')
    rx = backend.compile(RegexConstraint(r"[0-9]{3}-[a-z]+"))
    assert _accepts(backend, rx, "123-abc") and not _accepts(backend, rx, "12-abc")
    eb = backend.compile(EbnfConstraint('root ::= "yes" | "no" rest\nrest ::= [0-9]*'))
    assert _accepts(backend, eb, "no42") and not _accepts(backend, eb, "yes1")
    choices = ('say "hi"', "back\\slash", "two\nlines", "tab\there", "plain", "a|b(c)*")
    ch = backend.compile(ChoiceConstraint(choices))
    for c in choices:
        assert _accepts(backend, ch, c), c
    for c in ("say hi", "plai", "plainx", "a", "ab(c)"):
        assert not _accepts(backend, ch, c), c
    m = backend.create_matcher(ch)
    ids = backend.tokenizer_info  # the stop id ends a finished choice
    assert ids.vocab_size == backend.vocab_size
    assert m.xgr_matcher.accept_string("plain") and m.accept_token(STOP_ID)
    assert m.is_terminated()


def test_timeout_expired_and_dedupe(hf_tokenizer: Any) -> None:
    """Once the compile processes are up, a request's budget counts from its submission,
    queue wait included; a waiter that joins an in-flight compile shares it; the timeout error
    names the real limit; a limit spent in the queue is not cached against the grammar."""
    b = GrammarBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[STOP_ID],
                       config=GrammarConfig(compile_timeout_s=60, num_compile_threads=1,
                                            num_small_compile_workers=0))
    try:
        b.compile(ChoiceConstraint(("warm",)), timeout=120)  # the processes are up
        # holds the one worker for seconds (1,000 properties: ~7 s on a 2-core VM)
        blocker = b.submit(JsonSchemaConstraint({"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(1000)}}, strict=False))
        b.config = dataclasses.replace(b.config, compile_timeout_s=0.3)
        spec = RegexConstraint("slow[0-9]+")
        fut = b.submit(spec)  # it can only wait in the queue behind the blocker
        twin = b.submit(spec)
        assert twin._entry is fut._entry and b.cache_size() == 3  # in-flight dedupe
        assert not fut.done() and not fut.expired(time.perf_counter())
        with pytest.raises(GrammarError, match=r"within the 0.3 s limit") as info:
            fut.result()
        assert info.value.param == "regex" and info.value.code == "grammar_too_complex"
        assert fut.expired(time.perf_counter()) or fut.done()
        assert blocker._entry.job is not None
        b.pool.cancel([blocker._entry.job])  # frees the worker
        b.config = dataclasses.replace(b.config, compile_timeout_s=60)
        assert isinstance(b.submit(spec).result(timeout=60), xgr.CompiledGrammar)
    finally:
        b.shutdown()


def test_lru_bound(hf_tokenizer: Any) -> None:
    b = GrammarBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[STOP_ID],
                       config=GrammarConfig(cache_max_entries=2, num_compile_threads=1))
    for p in ("a+", "b+", "c+"):
        b.compile(RegexConstraint(p))
    assert b.cache_size() == 2
    keys = [k for k, _ in b._cache.items()]
    assert keys == [b._key(RegexConstraint(p), p) for p in ("b+", "c+")]
    b.shutdown()


def test_property_order_is_kept(backend: GrammarBackend) -> None:
    """xgrammar emits properties in declared order: the cache key must not sort them."""
    first = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
             "required": ["z", "a"]}
    second = {"type": "object", "properties": {"a": {"type": "integer"}, "z": {"type": "integer"}},
              "required": ["z", "a"]}
    cg1 = backend.compile(JsonSchemaConstraint(first))
    cg2 = backend.compile(JsonSchemaConstraint(second))
    assert _accepts(backend, cg1, '{"z": 1, "a": 2}')
    assert _accepts(backend, cg2, '{"a": 2, "z": 1}')


def test_metaschema_violations_that_compile_are_not_refused(backend: GrammarBackend) -> None:
    """The metaschema only explains compile failures: a schema that breaks it in ways the
    grammar does not care about (a non-string ``title``, a repeated ``required`` name) is
    compiled and enforced, not refused."""
    from structspec.grammar.backend import metaschema_problem

    spec = JsonSchemaConstraint({"type": "object", "title": 5,
                           "properties": {"a": {"type": "string"}}, "required": ["a", "a"]})
    assert metaschema_problem(spec) is not None  # 2020-12 says it is invalid
    cg = backend.compile(spec)
    assert _accepts(backend, cg, '{"a": "x"}') and not _accepts(backend, cg, '{}')
