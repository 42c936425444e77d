"""Structural tags on the grammar backends: what the compiled grammar accepts, token by token
(free text, then after a trigger only a begin string, a body valid under its JSON Schema and the
end string), the legacy form against the current one, the JSON Schema treatment of a tag's
schemas (against a ``json_schema`` grammar), and the refusals, each naming its place."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from xgrammar import structural_tag as xst

from structspec.config import GrammarConfig
from structspec.constraints import JsonSchemaConstraint, StructuralTagConstraint
from structspec.grammar import GrammarBackend, GrammarError, allocate_bitmask
from structspec.grammar.limits import find_limit_problem
from structspec.grammar.precheck import check_grammar
from structspec.grammar.select_backend import SelectingBackend
from structspec.grammar.structural_tag_grammar import structural_tag_input
from structspec.structural_tag import FORMAT_FIELDS, REQUIRED_FIELDS

from .conftest import STOP_ID

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TRIGGER = "<function="
LEGACY = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                          "end": "</function>"},
                         {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"}],
          "triggers": [TRIGGER]}
CURRENT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": [TRIGGER],
    "tags": [{"type": "tag", "begin": "<function=get_weather>",
              "content": {"type": "json_schema", "json_schema": WEATHER},
              "end": "</function>"},
             {"type": "tag", "begin": "<function=get_time>",
              "content": {"type": "json_schema", "json_schema": TIME}, "end": "</function>"}]}}
BODIES = [  # (function, compact JSON body); valid or not by jsonschema
    ("get_weather", {"city": "Paris", "days": 3}),
    ("get_weather", {"city": "Oslo", "days": -12}),
    ("get_weather", {"city": 3, "days": 3}),
    ("get_weather", {"city": "Paris"}),
    ("get_weather", {"city": "Paris", "days": 3, "extra": True}),
    ("get_weather", {"city": "Paris", "days": 2.5}),
    ("get_time", {"zone": "UTC"}),
    ("get_time", {"zone": "PST"}),
    ("get_time", {"city": "Paris", "days": 3}),
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _accepts(backend: GrammarBackend, compiled: Any, ids: list[int]) -> bool:
    """Whether the matcher takes every id (then the stop token)."""
    m = backend.create_matcher(compiled)
    return m.accept_run([*ids, STOP_ID]) == len(ids) + 1


def _texts() -> list[tuple[str, bool]]:
    """Outputs and whether they are in the tag's language (by jsonschema for the bodies)."""
    out = [("Just some free text, no call.", True), ("", True),
           ("Sure.\n<function=get_weather>{\"city\": \"Rome\", \"days\": 1}</function> Then "
            "<function=get_time>{\"zone\": \"CET\"}</function> done.", True),
           # after a trigger only a begin string: an unknown function, or text
           ("I will call <function=get_news>{}</function>", False),
           ("A <function= by itself", False),
           # the end string, right after the body (compact JSON: no space before it)
           ("<function=get_time>{\"zone\": \"UTC\"} </function>", False),
           ("<function=get_time>{\"zone\": \"UTC\"}</func>", False),
           # a call that never ends
           ("<function=get_time>{\"zone\": \"UTC\"}", False)]
    for name, body in BODIES:
        valid = jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(body)
        out.append((f"Calling. <function={name}>{json.dumps(body)}</function>", valid))
    return out


@pytest.fixture(scope="module")
def tag_grammar(backend: GrammarBackend) -> Any:
    return backend.compile(StructuralTagConstraint(LEGACY), timeout=60)


def test_reader_tables_match_xgrammars_formats() -> None:
    """Every format type of xgrammar's pydantic models, with its keys and required keys, is in
    the reader's tables (and nothing else): a key the reader refuses xgrammar would read."""
    models = [m for m in vars(xst).values() if isinstance(m, type)
              and issubclass(m, xst.BaseModel) and "type" in m.model_fields
              and m not in (xst.StructuralTag,)]
    ours = {}
    required = {}
    for m in models:
        kind = m.model_fields["type"].default
        ours[kind] = set(m.model_fields) - {"type"}
        required[kind] = {f for f, info in m.model_fields.items() if info.is_required()}
    assert ours == {k: set(v) for k, v in FORMAT_FIELDS.items()}
    assert required == {k: set(REQUIRED_FIELDS.get(k, ())) for k in FORMAT_FIELDS}
    assert set(xst.StructuralTagItem.model_fields) == {"begin", "schema_", "end"}


def test_free_text_then_only_the_tagged_section(backend: GrammarBackend, tag_grammar: Any,
                                                hf_tokenizer: Any) -> None:
    """Free text, calls with valid bodies and text after them are accepted; an unknown begin,
    a body its schema refuses (jsonschema's verdict), a wrong or missing end string are not."""
    for text, expected in _texts():
        assert _accepts(backend, tag_grammar, _ids(hf_tokenizer, text)) == expected, text


def test_after_a_trigger_only_begin_strings_are_allowed(backend: GrammarBackend,
                                                        tag_grammar: Any,
                                                        hf_tokenizer: Any) -> None:
    """The mask after ``<function=``: every allowed token continues one of the begin strings
    (the longest may run on into the body's ``{``); no stop token, nothing else."""
    m = backend.create_matcher(tag_grammar)
    ids = _ids(hf_tokenizer, "Let me look. " + TRIGGER)
    assert m.accept_run(ids) == len(ids)
    bitmask = allocate_bitmask(1, backend.vocab_size, pin=False)
    m.fill_bitmask(bitmask, 0)
    bits = torch.tensor([(int(w) >> b) & 1 for w in bitmask[0].tolist() for b in range(32)])
    allowed = bits[: backend.vocab_size].nonzero().flatten().tolist()
    vocab = backend.tokenizer_info.decoded_vocab
    rests = ["get_weather>", "get_time>"]
    assert STOP_ID not in allowed and len(allowed) > 2
    for t in allowed:
        s = vocab[t].decode("utf-8", "replace")
        assert any(r.startswith(s) or (s.startswith(r) and "{".startswith(s[len(r):][:1]))
                   for r in rests), repr(s)
    # both functions' names can start here
    assert any(vocab[t].decode() in ("get", "get_") for t in allowed)


def test_legacy_form_equals_the_converted_form(backend: GrammarBackend, tag_grammar: Any,
                                               hf_tokenizer: Any) -> None:
    """The legacy form is xgrammar's own conversion of it: the same compile input and the
    same verdict on every text."""
    assert (structural_tag_input(StructuralTagConstraint(LEGACY), any_whitespace=False)
            == structural_tag_input(StructuralTagConstraint(CURRENT), any_whitespace=False))
    current = backend.compile(StructuralTagConstraint(json.dumps(CURRENT)), timeout=60)
    for text, _ in _texts():
        ids = _ids(hf_tokenizer, text)
        assert _accepts(backend, current, ids) == _accepts(backend, tag_grammar, ids), text


@pytest.mark.parametrize("bounded", [True, False])
def test_a_tags_schema_is_served_as_a_json_schema_request(backend: GrammarBackend,
                                                          hf_tokenizer: Any,
                                                          bounded: bool) -> None:
    """A tag that is one ``json_schema`` format allows, token after token, exactly what the
    ``json_schema`` grammar of its schema allows: the exact rewrites (``allOf`` merged), the
    compact separators and the default number bounds (lifted together)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "x": {"allOf": [{"type": "integer"},
                                                               {"minimum": 3}]},
                                               "any": {}}, "required": ["any"]}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    a = backend.compile(StructuralTagConstraint(tag, strict=False, bounded_numbers=bounded),
                        timeout=60)
    b = backend.compile(JsonSchemaConstraint(schema, strict=False, bounded_numbers=bounded),
                        timeout=60)
    text = json.dumps({"n": 12345678901234567890123, "any": [1.5, 123456789012345678901]})
    ids = _ids(hf_tokenizer, text)
    ma, mb = backend.create_matcher(a), backend.create_matcher(b)
    mask_a = allocate_bitmask(1, backend.vocab_size, pin=False)
    mask_b = allocate_bitmask(1, backend.vocab_size, pin=False)
    steps = 0
    for t in ids:
        ma.fill_bitmask(mask_a, 0)
        mb.fill_bitmask(mask_b, 0)
        assert torch.equal(mask_a, mask_b), steps
        ok = ma.accept_token(t)
        assert ok == mb.accept_token(t), steps
        if not ok:
            break
        steps += 1
    assert (steps == len(ids)) == (not bounded)  # 23 digits: past the default bound
    # the merged allOf: xgrammar alone would take any JSON for "x" (it ignores allOf here)
    below = _ids(hf_tokenizer, '{"x": 1, "any": 1}')
    assert not _accepts(backend, a, below) and not _accepts(backend, b, below)
    assert _accepts(backend, a, _ids(hf_tokenizer, '{"x": 4, "any": 1}'))


def test_strict_refusal_names_the_schemas_place(backend: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string", "format": "date"}}}
    legacy = {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"},
                             {"begin": "<b>", "schema": schema, "end": "</b>"}],
              "triggers": ["<"]}
    with pytest.raises(GrammarError) as e:
        backend.compile(StructuralTagConstraint(legacy), timeout=60)
    assert e.value.param == "structural_tag.structures[1].schema"
    assert "structures[1].schema/properties/x: 'format': 'date'" in str(e.value)
    assert "set strict to false" in str(e.value)
    backend.compile(StructuralTagConstraint(legacy, strict=False), timeout=60)
    current = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Date: "},
        {"type": "json_schema", "json_schema": schema}]}}
    with pytest.raises(GrammarError) as e:
        backend.compile(StructuralTagConstraint(current), timeout=60)
    assert e.value.param == "structural_tag.format.elements[1].json_schema"
    assert "format.elements[1].json_schema/properties/x" in str(e.value)


@pytest.mark.parametrize("tag, param, fragment", [
    ({**LEGACY, "triggers": [TRIGGER, "<tool"]}, "structural_tag.triggers[1]",
     "trigger '<tool' is not a prefix of any tag's begin"),
    ({**LEGACY, "structures": []}, "structural_tag.structures", "non-empty list"),
    ({"structures": [{"begin": "<a>", "schema": {"type": "objectz"}, "end": "</a>"}],
      "triggers": ["<a"]}, "structural_tag.structures[0].schema",
     "the JSON Schema at structures[0].schema: invalid JSON Schema at /type"),
    ({"structures": [{"begin": "<a>", "schema": {"$ref": "#/$defs/nope"}, "end": "</a>"}],
      "triggers": ["<a"]}, "structural_tag.structures[0].schema", "points to nothing"),
    ({"structures": [{"begin": "<a>", "schema": {"not": {}}, "end": "</a>"}],
      "triggers": ["<a"]}, "structural_tag.structures[0].schema", "accepts no finite JSON value"),
    ({"type": "structural_tag", "format": {"type": "any_text", "max_token": 3}},
     "structural_tag.format.max_token", "unknown key 'max_token'"),
    # a token budget is not exact under speculation (a draft tree's walk let a fifth token
    # through a budget of 4 that plain decoding refused)
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "max_tokens": 4}, {"type": "const_string", "value": "\nEND"}]}},
     "structural_tag.format.elements[0].max_tokens", "not enforced exactly under speculative"),
    ({"type": "structural_tag", "format": {"type": "regex", "pattern": "[z-a]"}},
     "structural_tag", "Failed to compile structural_tag grammar"),
    ("[1, 2]", "structural_tag", "must be a JSON object"),
    ({"type": "structural_tag", "format": {"type": "repeat", "min": 5, "max": 2, "content": {
        "type": "const_string", "value": "a"}}}, "structural_tag.format",
     "a repeat needs 0 <= min <= max"),
    ({"type": "structural_tag", "format": {"type": "repeat", "min": 0, "max": 10**30,
                                           "content": {"type": "const_string", "value": "a"}}},
     "structural_tag.format.max", "must be an integer in [-1, 2147483647]"),
])
def test_bad_tags_fail_naming_the_place(backend: GrammarBackend, tag: Any, param: str,
                                        fragment: str) -> None:
    """Each refusal names the place in the tag, in the engine and in the CLI's precheck."""
    with pytest.raises(GrammarError) as e:
        backend.compile(StructuralTagConstraint(tag), timeout=60)
    assert e.value.param == param and fragment in str(e.value), (e.value.param, str(e.value))
    # the command line's precheck (no tokenizer) refuses it the same way
    with pytest.raises(GrammarError) as pre:
        check_grammar(StructuralTagConstraint(tag))
    assert pre.value.param == param


def test_precheck_passes_a_good_tag_and_limits_name_the_place() -> None:
    check_grammar(StructuralTagConstraint(LEGACY))
    spec = StructuralTagConstraint(LEGACY)
    problem = find_limit_problem(spec, spec.canonical_text(),
                                 GrammarConfig(max_schema_properties=1))
    assert problem is not None and problem.startswith(
        "the JSON Schema at structures[0].schema: /: 'properties' has 2 entries")


def test_llguidance_refuses_and_auto_serves_on_xgrammar(backend: GrammarBackend,
                                                        llg_backend: Any) -> None:
    spec = StructuralTagConstraint(LEGACY)
    with pytest.raises(GrammarError) as e:
        llg_backend.compile(spec, timeout=60)
    assert e.value.param == "structural_tag" and "xgrammar only" in str(e.value)
    auto = SelectingBackend("auto", xgrammar=backend, llguidance=llg_backend)
    compiled = auto.compile(spec, timeout=60)
    assert isinstance(compiled, xgr.CompiledGrammar)
    assert auto.create_matcher(compiled).backend == "xgrammar"


def test_a_large_tags_bad_begin_is_named() -> None:
    """30,000 structures, the last begin matching no trigger: refused naming it. (The check
    compared every begin with every trigger, ~50 s of the server's event loop on this tag; it
    now looks each begin's prefixes up in a set. No timing is asserted here: the suite's
    durations show a regression.)"""
    from structspec.structural_tag import StructuralTagError, read_structural_tag

    n = 30_000
    structures = [{"begin": f"<f{i:05d}>", "schema": {"type": "integer"}, "end": "</f>"}
                  for i in range(n)]
    structures[-1]["begin"] = "<zzz>"
    tag = {"structures": structures, "triggers": [f"<f{i:05d}" for i in range(n)]}
    with pytest.raises(StructuralTagError) as e:
        read_structural_tag(tag)
    assert e.value.where == f"structures[{n - 1}].begin"


def test_hermes_tag_without_parallel_calls_ends_after_the_first(backend: GrammarBackend,
                                                                 hf_tokenizer: Any) -> None:
    """``parallel_tool_calls: false`` with auto tool calls: the Hermes tag in its current form
    with ``stop_after_first`` takes text then one call, then only the stop token; the same
    tools' default tag (legacy form) takes a second call. A body its schema refuses is refused
    by both."""
    from structspec.server.hermes_tools import call_begin, hermes_tag

    tools = [{"name": "get_weather", "parameters": WEATHER},
             {"name": "get_time", "parameters": TIME}]
    single = backend.compile(hermes_tag(tools, parallel=False), timeout=60)
    several = backend.compile(hermes_tag(tools), timeout=60)

    def call(name: str, body: dict[str, Any]) -> str:
        return call_begin(name) + json.dumps(body) + "}\n</tool_call>"

    one = "Let me check.\n" + call("get_weather", {"city": "Rome", "days": 1})
    two = one + "\n" + call("get_time", {"zone": "UTC"})
    bad = call("get_time", {"zone": "PST"})
    for text, single_ok, several_ok in [(one, True, True), (two, False, True),
                                        (one + " Done.", False, True), (bad, False, False),
                                        ("No call at all.", True, True)]:
        ids = _ids(hf_tokenizer, text)
        assert _accepts(backend, single, ids) == single_ok, text
        assert _accepts(backend, several, ids) == several_ok, text
    # after the first call's section only the stop token is left
    m = backend.create_matcher(single)
    ids = _ids(hf_tokenizer, one)
    assert m.accept_run(ids) == len(ids)
    bitmask = allocate_bitmask(1, backend.vocab_size, pin=False)
    m.fill_bitmask(bitmask, 0)
    bits = torch.tensor([(int(w) >> b) & 1 for w in bitmask[0].tolist() for b in range(32)])
    assert bits[: backend.vocab_size].nonzero().flatten().tolist() == [STOP_ID]
