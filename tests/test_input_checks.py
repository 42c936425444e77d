"""Bad values given to the Python API and the CLI are refused naming the field (or flag)
and the expected type, before any model loads. Each case used to fail unclearly: an
AttributeError naming no field, a TypeError from a comparison, an empty regex accepted, a
schema refused only after the model had loaded."""

from __future__ import annotations

from typing import Any

import pytest

from structspec.cli import build_parser, main
from structspec.config import EngineConfig, SpecConfig, resolve_engine_config
from structspec.constraints import EbnfConstraint, JsonSchemaConstraint, RegexConstraint
from structspec.core import SEED_MAX, SEED_MIN, SamplingParams
from structspec.engine_args import flag_error
from structspec.grammar.errors import GrammarError
from structspec.grammar.precheck import check_grammar
from structspec.speculative.registry import registered_drafter


@pytest.mark.parametrize("grammar", ["text", {"type": "object"}, 5])
def test_a_grammar_that_is_not_a_constraint_names_grammar(grammar: Any) -> None:
    with pytest.raises(ValueError, match=r"^grammar must be None or one of JsonSchemaConstraint"):
        SamplingParams(grammar=grammar).validate()


def test_regex_constraint_refuses_empty_and_non_string_patterns() -> None:
    with pytest.raises(ValueError, match=r"RegexConstraint\.pattern must be a non-empty"):
        RegexConstraint("")
    with pytest.raises(TypeError, match=r"RegexConstraint\.pattern must be a str, got int 5"):
        RegexConstraint(5)  # type: ignore[arg-type]
    assert RegexConstraint("a+").pattern == "a+"


@pytest.mark.parametrize("grammar", [123, None, b'root ::= "a"', ['root ::= "a"']])
def test_ebnf_constraint_refuses_non_string_grammars(grammar: Any) -> None:
    """A non-string grammar used to pass the constructor and end the whole ``generate`` call
    in the grammar cache's key (``'int' object has no attribute 'encode'``)."""
    with pytest.raises(TypeError, match=r"EbnfConstraint\.grammar must be a str, got "
                                        f"{type(grammar).__name__}"):
        EbnfConstraint(grammar)
    assert EbnfConstraint('root ::= "a"').grammar == 'root ::= "a"'


@pytest.mark.parametrize("strict", ["no", "false", 0, 1, None])
def test_json_schema_strict_takes_booleans_only(strict: Any) -> None:
    """``strict="no"`` is truthy: it used to mean a strict compile."""
    with pytest.raises(TypeError, match=r"^JsonSchemaConstraint\.strict must be True or "
                                        r"False, got "):
        JsonSchemaConstraint({"type": "object"}, strict=strict)
    assert JsonSchemaConstraint({"type": "object"}, strict=False).strict is False


@pytest.mark.parametrize("seed", [SEED_MIN - 1, SEED_MAX + 1])
def test_engine_seed_takes_the_one_seed_range(seed: int) -> None:
    """``LLM(seed=...)`` and ``--seed`` take the range of request seeds
    (:data:`structspec.core.SEED_MAX`), as ``SamplingParams.seed`` and the server do."""
    with pytest.raises(ValueError, match=r"^seed must be in \[0, 9223372036854775807\]"):
        resolve_engine_config(EngineConfig(device="cpu", seed=seed))
    resolve_engine_config(EngineConfig(device="cpu", seed=SEED_MAX))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--seed", str(seed)])
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--seed", str(SEED_MAX)])
    assert args.seed == SEED_MAX


def test_stop_token_ids_past_int64_are_refused() -> None:
    with pytest.raises(ValueError, match=r"stop_token_ids must be a list of integers in \[0, 2\*\*63\)"):
        SamplingParams(stop_token_ids=(2**64,)).validate()


@pytest.mark.parametrize("spec,field,flag", [
    (SpecConfig(algorithm="ngram", num_draft_tokens="8"), "num_draft_tokens",  # type: ignore[arg-type]
     "--num-draft-tokens"),
    (SpecConfig(algorithm="none", num_draft_tokens="8"), "num_draft_tokens",  # type: ignore[arg-type]
     "--num-draft-tokens"),
    (SpecConfig(algorithm="ngram", depth=2.5), "speculative_depth",  # type: ignore[arg-type]
     "--speculative-depth"),
])
def test_integer_engine_options_of_another_type_name_the_option(spec: SpecConfig, field: str,
                                                                flag: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=.*: expected an integer, got") as e:
        resolve_engine_config(EngineConfig(device="cpu", spec=spec))
    assert flag_error(str(e.value)).startswith(f"{flag}: {field}=")


def test_speculative_algorithm_help_follows_the_registry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps at the terminal's width

    def help_text() -> str:  # `structspec serve --help` as rendered, whitespace joined
        sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
        return " ".join(sub.format_help().split())

    text = help_text()
    assert "ngram (n-gram prompt lookup)" in text
    assert ("eagle (an EAGLE head; needs --draft-model, except on the default model (shipped "
            "head))") in text
    assert "draft_model (a small draft model; needs --draft-model)" in text
    assert "toy50" not in text
    with registered_drafter("toy50", lambda spec, **_: None,  # type: ignore[arg-type,return-value]
                            description="a 50% toy"):
        assert "toy50 (a 50% toy)" in help_text()
    assert "toy50" not in help_text()


@pytest.mark.parametrize("flags,words", [
    # where the schema breaks its metaschema, then the compiler's words (as the engine says)
    (["--json-schema", '{"type": "foo"}'],
     "--json-schema: Failed to compile json_schema grammar: invalid JSON Schema at /type: "
     "'foo' is not valid under any of the given schemas (compiler: Unsupported type \"foo\")"),
    (["--json-schema", '{"properties": {"type": {"type": "string"}, "a": {"type": ["x"]}}}'],
     "--json-schema: Failed to compile json_schema grammar: invalid JSON Schema at "
     "/properties/a/type/0: 'x' is not one of"),
    (["--json-schema", '{"type": "object", "properties": 3}'],
     "--json-schema: Failed to compile json_schema grammar: invalid JSON Schema at "
     "/properties: 3 is not of type 'object' (compiler: properties must be an object)"),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'],
     "--json-schema: json_schema cannot be enforced exactly in strict mode"),
    (["--regex", "(ab"], "--regex: Failed to compile regex grammar"),
    # without xgrammar's "EBNF parser error at line 1, column 11" (a text the user never wrote)
    (["--regex", "[z-a]"], "--regex: Failed to compile regex grammar: Invalid character class"),
])
def test_a_grammar_flag_the_compiler_refuses_exits_2_before_loading(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "invalid JSON Schema at" in words:
        pytest.importorskip("jsonschema")  # the pointer comes from its metaschema check
    # the model path does not exist: reaching the load would be a different error
    code = main(["generate", "--model", "/nonexistent/model", "--device", "cpu",
                 "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert "/nonexistent/model" not in err


@pytest.mark.parametrize(("flags", "words"), [
    (["--grammar-backend", "llguidance", "--ebnf", "root ::= foo"],
     "--ebnf: Failed to compile ebnf grammar (llguidance)"),
    (["--grammar-backend", "llguidance", "--regex", "(abc"],
     "--regex: Failed to compile regex grammar (llguidance)"),
    (["--grammar-backend", "auto", "--json-schema",
      '{"type": "object", "not": {"pattern": "a"}}'],
     "(xgrammar: json_schema cannot be enforced exactly in strict mode"),
])
def test_llguidance_and_auto_refuse_before_loading(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """llguidance / auto: refused before the load only when the chosen backend (auto: both)
    would refuse it."""
    code = main(["generate", "--model", "/nonexistent/model", "--device", "cpu",
                 "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert "/nonexistent/model" not in err


def test_auto_refusal_keeps_xgrammars_caret_block_whole(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Both backends refuse an EBNF grammar with ``auto``: xgrammar's error (its grammar line
    and caret) used to be wrapped as ``(xgrammar: ...)``, its ``)`` at the end of the caret
    line; now it follows on lines of its own, the caret line last and bare."""
    code = main(["generate", "--model", "/nonexistent/model", "--device", "cpu",
                 "--prompt", "hi", "--grammar-backend", "auto",
                 "--ebnf", 'root ::= "a"\nb ::= "x" ]\n'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("structspec generate: --ebnf: Failed to compile ebnf "
                                        "grammar (llguidance): "), err
    assert ("\nxgrammar: Failed to compile ebnf grammar: EBNF lexer error at line 2, column 11: "
            "Unexpected character: ]\n  line 2: b ::= \"x\" ]\n"
            "                    ^\n") in err, err
    assert err.endswith("^\n") and "(xgrammar:" not in err, err


def test_backend_note_goes_on_its_own_lines_after_a_caret_block() -> None:
    from structspec.grammar.compile_spec import with_backend_note

    assert with_backend_note("bad", "xgrammar", "worse") == "bad (xgrammar: worse)"
    caret = "Expect element\n  line 1: a ::=\n              ^"
    assert with_backend_note(caret, "xgrammar", "ran out of its compile time") == \
        caret + "\nxgrammar: ran out of its compile time"
    assert with_backend_note("bad", "xgrammar", caret) == "bad\nxgrammar: " + caret


def test_auto_precheck_passes_what_llguidance_serves() -> None:
    """A schema xgrammar's strict check refuses but llguidance serves is not refused up front
    with ``auto`` (it reaches the model load, which fails on the missing path)."""
    from structspec.grammar.llg_compile import check_grammar_llguidance

    schema = {"type": "object", "not": {"required": ["b"]}}
    check_grammar_llguidance(JsonSchemaConstraint(schema))
    check_grammar_llguidance(EbnfConstraint('root ::= "a" | "b"'))


def test_precheck_passes_what_compiles() -> None:
    check_grammar(JsonSchemaConstraint({"type": "object", "properties": {"a": {"type": "string"}}}))
    check_grammar(RegexConstraint(r"\d{3}"))
    check_grammar(EbnfConstraint('root ::= "a" | "b"'))
    check_grammar(None)
    with pytest.raises(GrammarError, match="Failed to compile ebnf grammar") as e:
        check_grammar(EbnfConstraint("start ::= 'a'"))
    assert e.value.param == "ebnf"


def test_precheck_refuses_a_schema_with_no_finite_value() -> None:
    """The CLI refuses it before the model loads, as the engine would (issue 17)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(GrammarError, match="accepts no finite JSON value"):
        check_grammar(JsonSchemaConstraint(schema, strict=False))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"stop": 5}, "stop must be a string or a list of non-empty strings, got 5"),
    ({"stop": {"a": 1}}, "stop must be a string or a list of non-empty strings, got {'a': 1}"),
    ({"stop": ["a", ""]}, "stop must be a string or a list of non-empty strings"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers in [0, 2**63), got 5"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list of integers"),
])
def test_stop_fields_of_another_type_name_the_field(kwargs: dict, words: str) -> None:
    """Refused by validate() naming the field (construction raised a bare TypeError for an
    int and kept a dict's keys)."""
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as e:
        params.validate()
    assert words in str(e.value)


def test_stop_fields_take_any_iterable() -> None:
    """A range, a set, a generator: turned into tuples, as before (only non-iterables and
    mappings are refused)."""
    assert SamplingParams(stop_token_ids=range(3)).stop_token_ids == (0, 1, 2)
    assert SamplingParams(stop={"a"}).stop == ("a",)
    assert SamplingParams(stop=(s for s in ["x"])).stop == ("x",)
    with pytest.raises(ValueError, match="stop must be a string or a list"):
        SamplingParams(stop=b"ab").validate()


def test_best_effort_precheck_passes_what_the_engine_serves_as_sent() -> None:
    """A schema whose exact rewrite xgrammar refuses (``not`` of a ``required`` set becomes
    ``"a": false``) is served as sent in best effort; the CLI's precheck refused it."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "not": {"required": ["a"]}}
    check_grammar(JsonSchemaConstraint(schema, strict=False))


def test_stop_fields_take_none_a_string_and_lists() -> None:
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop="x").stop == ("x",)
    params = SamplingParams(stop=["x", "y"], stop_token_ids=[1, 2])
    params.validate()
    assert params.stop == ("x", "y") and params.stop_token_ids == (1, 2)


@pytest.mark.parametrize(("value", "lark_hint"), [
    ('start: "a" | "b"', True), ("?value: NUMBER", True), ("grammars/x.gbnf", False),
    ("// a comment\nstart: x", True), ("%import common.NUMBER\nstart: NUMBER", True),
    ("https://host/x.gbnf", False), ("C:\\g\\x.gbnf", False),
])
def test_ebnf_flag_neither_a_file_nor_a_grammar_says_so(
        value: str, lark_hint: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped path, or a Lark grammar (which no grammar kind reads): exit 2 before the
    load, naming the flag, with a hint for Lark rules."""
    code = main(["generate", "--model", "/nonexistent/model", "--device", "cpu",
                 "--prompt", "hi", "--ebnf", value])
    err = capsys.readouterr().err
    assert code == 2 and "--ebnf: no such file" in err, err
    assert ("Lark rules ('name: ...') are not read" in err) == lark_hint, err


def test_batch_line_stop_null_means_none() -> None:
    """``"stop": null`` on a ``--batch`` line, as the server and SamplingParams take it."""
    from structspec.cli import _params

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert _params(args, None, {"stop": None}).stop == ()
    with pytest.raises(ValueError, match="stop must be a string or a list of strings, got 5"):
        _params(args, None, {"stop": 5})
