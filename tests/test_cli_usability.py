"""``structspec generate`` as a vLLM / sglang user expects it (issue 23): text mode prints
text (with a notice on stderr when an answer stopped at ``length``), ``--version``, inline
``--ebnf`` and its full parser error, speculative flags named as typed, and values argparse
or the engine used to misread (``-inf``, ``--max-tokens 10**20``, an out-of-vocabulary
``--logit-bias`` id). No model loads: :class:`tests.test_cli._FakeLLM` stands in for it."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from structspec.cli import main
from structspec.core import FinishReason, RequestOutput, SamplingParams
from tests.test_cli import _FakeLLM


class _LengthLLM(_FakeLLM):
    """Every answer stops at ``max_tokens`` (``finish_reason`` length)."""

    def generate(self, prompts: Any, params: Any, **kwargs: Any) -> list[RequestOutput]:
        outs = super().generate(prompts, params, **kwargs)
        for out, (_, p) in zip(outs, _FakeLLM.seen[-len(outs):], strict=True):
            if out.error is None:
                out.token_ids = [2] * p.max_tokens
                out.text = "Italy is indeed"
                out.finish_reason = FinishReason.LENGTH
        return outs


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         argv: list[str], fake: type[_FakeLLM] = _FakeLLM) -> tuple[int, str, str]:
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", fake)
    _FakeLLM.seen = []
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _batch_file(tmp_path: Path) -> Path:
    path = tmp_path / "batch.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"prompt": "b"}) + "\n"
                    + json.dumps({"prompt": "c", "max_token": 1}) + "\n")
    return path


def test_batch_text_output_prints_only_texts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``--batch --output text`` used to print the JSON records; now one block per record,
    under its input line's header (a bad line's header says error; why is on stderr)."""
    rc, out, err = _run(monkeypatch, capsys, ["generate", "--batch", str(_batch_file(tmp_path)),
                                              "--output", "text"])
    assert rc == 1 and out == "### line 1\nok\n### line 3\nok\n### line 4: error\n", out
    assert "batch.jsonl:4: bad record" in err
    # without --output a batch still writes JSONL records (each with its line)
    rc, out, _ = _run(monkeypatch, capsys, ["generate", "--batch", str(_batch_file(tmp_path))])
    assert [json.loads(s)["line"] for s in out.splitlines()] == [1, 3, 4]


def test_text_mode_notes_an_answer_cut_at_max_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--max-tokens", "10"],
                        _LengthLLM)
    assert rc == 0 and out == "Italy is indeed\n"
    assert err == "[finish_reason=length: stopped at --max-tokens 10]\n", err
    rc, out, err = _run(monkeypatch, capsys, ["generate", "--batch", str(_batch_file(tmp_path)),
                                              "--output", "text", "--max-tokens", "3"],
                        _LengthLLM)
    assert "line 1: [finish_reason=length: stopped at max_tokens 3]" in err
    rc, out, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--output", "json"],
                        _LengthLLM)
    assert json.loads(out)["finish_reason"] == "length" and "finish_reason" not in err


def test_length_notice_names_the_repetition_stop_and_the_context() -> None:
    from structspec.cli_output import length_notice

    out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[2, 3], text="x",
                        finished=True, finish_reason=FinishReason.LENGTH)
    assert "context length" in length_notice(out, SamplingParams(max_tokens=10))
    out.stop_reason = "repetition"
    assert "--stop-on-repeat" in length_notice(out, SamplingParams(max_tokens=10))
    out.finish_reason = FinishReason.STOP
    assert length_notice(out, SamplingParams(max_tokens=10)) is None


def test_version_prints_the_package_version() -> None:
    """``structspec --version`` (a subprocess: argparse exits), fast: no torch import."""
    proc = subprocess.run([sys.executable, "-m", "structspec", "--version"],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"structspec {metadata.version('structspec')} (torch ")


@pytest.mark.parametrize("grammar", ['root ::= "yes" | "no"', 'root ::= "a"\n'])
def test_inline_ebnf_is_accepted(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], grammar: str) -> None:
    rc, out, _ = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--ebnf", grammar])
    assert rc == 0 and _FakeLLM.seen[0][1].grammar.grammar == grammar


def test_ebnf_file_and_mistyped_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= "x"\n')
    rc, _, _ = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--ebnf", str(path)])
    assert rc == 0 and _FakeLLM.seen[0][1].grammar.grammar == 'root ::= "x"\n'
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--ebnf",
                                            str(tmp_path / "missing.gbnf")])
    assert rc == 2 and "--ebnf: no such file" in err and _FakeLLM.seen == []


@pytest.mark.parametrize("flag,data,where", [
    ("--ebnf", b'root ::= "a"\nb ::= "\xc3\xa9x\xff"\n',
     "byte 0xff at offset 23 (line 2, column 10) cannot start a character"),
    ("--ebnf", b'root ::= "a\xe2\x82',
     "byte 0xe2 at offset 11 (line 1, column 12) starts a character the file ends inside"),
    ("--json-schema", b'{"type": "\xe9t"}',
     "byte 0xe9 at offset 10 (line 1, column 11) starts a character the next byte does not "
     "continue"),
])
def test_grammar_file_of_invalid_utf8_names_the_flag_and_the_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, data: bytes, where: str) -> None:
    """A grammar file that is not UTF-8 used to print Python's bare ``'utf-8' codec can't
    decode byte 0xff in position 23``: no flag, no file, no line; now exit 2 naming all of
    them before any model loads."""
    path = tmp_path / "grammar.txt"
    path.write_bytes(data)
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", flag, str(path)])
    assert rc == 2 and _FakeLLM.seen == []
    assert err == f"structspec generate: {flag}: {str(path)!r} is not UTF-8: {where}\n", err


@pytest.mark.parametrize("flag,data", [
    ("--json-schema", '{"type": "object"}'),
    ("--ebnf", 'root ::= "a"'),
    ("--logit-bias", '{"7": -3}'),
])
def test_a_file_flag_skips_a_utf8_bom(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, data: str) -> None:
    """A file that starts with a UTF-8 BOM (as editors on Windows write one) used to be
    refused (``--json-schema is neither a file nor valid JSON: Unexpected UTF-8 BOM``; GBNF
    failed on U+FEFF); ``--batch`` skipped it already."""
    path = tmp_path / "arg.txt"
    path.write_bytes(b"\xef\xbb\xbf" + data.encode())
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", flag, str(path)])
    assert rc == 0, err
    (_, params), = _FakeLLM.seen
    if flag == "--logit-bias":
        assert params.logit_bias == {7: -3}
    else:
        assert params.grammar is not None


@pytest.mark.parametrize("flag,data,message", [
    ("--json-schema", '{"type": ', "is not valid JSON: Expecting value: line 1 column 10"),
    ("--logit-bias", '{"100": 5,}', "is not valid JSON: Expecting property name"),
    ("--json-schema", None, "is a directory, not a file"),
    ("--ebnf", None, "is a directory, not a file"),
    ("--logit-bias", None, "is a directory, not a file"),
])
def test_a_file_flag_names_the_file_it_could_not_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, data: str | None, message: str) -> None:
    """A schema or logit-bias file that holds bad JSON used to read as a path that does not
    exist (``no such file '...' (and not inline JSON)``, ``neither a file nor valid JSON``),
    and a directory as no such file; now the flag and the path, and what is wrong with it."""
    path = tmp_path / "arg.json"
    if data is None:
        path.mkdir()
    else:
        path.write_text(data)
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", flag, str(path)])
    assert rc == 2 and _FakeLLM.seen == []
    assert err.startswith(f"structspec generate: {flag}: {str(path)!r} {message}"), err


def test_bad_ebnf_shows_the_whole_error_and_its_line_before_loading(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The parser error used to end at ``but got`` (xgrammar prints no character at the end);
    now it says where, shows the line with a caret, and exits 2 with nothing loaded."""
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--ebnf",
                                            'root ::= "a" b\nb ::= \n'])
    assert rc == 2 and _FakeLLM.seen == []
    assert "Expect element, but got (end of the grammar)\n  line 2: b ::=\n" in err, err
    assert err.startswith("structspec generate: --ebnf: Failed to compile ebnf grammar")
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--ebnf",
                                            'root ::= "a"\nb ::= | "x"'])
    assert 'but got |\n  line 2: b ::= | "x"\n' in err and err.rstrip().endswith("^"), err


@pytest.mark.parametrize("flags,message", [
    (["--speculative-algorithm", "eagle", "--model", "{cfg}"],
     "--speculative-algorithm eagle needs --draft-model DIR"),
    (["--speculative-algorithm", "draft_model"],
     "--speculative-algorithm draft_model needs --draft-model PATH"),
    (["--speculative-algorithm", "eagle", "--draft-model", "{gguf}"],
     "--draft-model: '{gguf}' is a file; an EAGLE-3 head is a directory with config.json and "
     "model.safetensors"),
    (["--speculative-algorithm", "eagle", "--draft-model", "{cfg}"],
     "--draft-model: '{cfg}' has no weights"),
    (["--speculative-algorithm", "draft_model", "--draft-model", "{cfg}"],
     "--draft-model: '{cfg}' has no weights"),
    (["--speculative-algorithm", "ngram", "--draft-model", "{cfg}"],
     "--draft-model is not used by --speculative-algorithm ngram"),
    (["--draft-model", "{cfg}"], "--draft-model is not used by --speculative-algorithm none"),
    (["--speculative-algorithm", "eagle", "--model", "{cfg}/nope"],
     "--model: no such file or directory"),
])
def test_speculative_flags_are_named_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flags: list[str], message: str) -> None:
    cfg = tmp_path / "head"
    cfg.mkdir()
    (cfg / "config.json").write_text("{}")
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF")
    names = {"cfg": str(cfg), "gguf": str(gguf)}
    argv = ["generate", "--prompt", "hi", *(f.format(**names) for f in flags)]
    rc, _, err = _run(monkeypatch, capsys, argv)
    assert rc == 2 and _FakeLLM.seen == []
    assert err.startswith(f"structspec generate: {message.format(**names)}"), err


def test_dummy_draft_model_needs_no_weights(tmp_path: Path) -> None:
    from structspec.draft_flags import check_model_and_draft_flags

    (tmp_path / "config.json").write_text("{}")
    check_model_and_draft_flags(None, "draft_model", str(tmp_path), load_format="dummy")


@pytest.mark.parametrize("value", ["-inf", "-nan", "-1e5", "-Infinity"])
def test_negative_float_spellings_reach_the_flag_check(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str) -> None:
    """argparse took ``-inf`` for an option (``expected one argument``)."""
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--temperature",
                                            value])
    assert rc == 2 and err.startswith("structspec generate: --temperature: temperature must "
                                      "be a finite number >= 0"), err
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi",
                                            "--presence-penalty", value])
    assert rc == 2 and "--presence-penalty: presence_penalty" in err, err


def test_huge_max_tokens_is_refused(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--max-tokens",
                                            str(10**20)])
    assert rc == 2 and err.startswith("structspec generate: --max-tokens: 1000") and (
        "at most 2147483647" in err), err
    assert _FakeLLM.seen == []


@pytest.mark.parametrize("batch", [False, True])
def test_out_of_vocab_logit_bias_is_a_bad_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        batch: bool) -> None:
    """Known only once the model has loaded, still exit 2 naming the flag, before any request
    runs (it was a failed request, exit 1)."""
    source = ["--batch", str(_batch_file(tmp_path))] if batch else ["--prompt", "hi"]
    rc, _, err = _run(monkeypatch, capsys, ["generate", *source, "--logit-bias",
                                            '{"49152": 5}'])
    assert rc == 2 and "--logit-bias: token id 49152 is not in this model's vocabulary" in err
    assert _FakeLLM.seen == []


_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("value,message", [
    ("{% for m in messages %}{{ m.content }}", "--chat-template: Jinja syntax error at line 1"),
    ("missing.jinja", "--chat-template: no such file 'missing.jinja'"),
    ("", "--chat-template: empty template"),
])
def test_bad_chat_template_is_a_bad_command_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str,
        value: str, message: str) -> None:
    pytest.importorskip("fastapi")
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    rc, _, err = _run(monkeypatch, capsys, [command, *extra, "--chat-template", value])
    assert rc == 2 and err.startswith(f"structspec {command}: {message}"), err
    assert _FakeLLM.seen == []


def test_chat_template_file_or_text_reaches_the_engine_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM(chat_template=)`` and ``serve``'s config carry the template's text (a file is
    read); ``generate --chat-template`` hands the flag to ``LLM``."""
    import structspec.llm as llm_mod
    from structspec.cli import build_parser
    from structspec.engine_args import engine_kwargs
    from structspec.server.launch import build_engine_config

    path = tmp_path / "t.jinja"
    path.write_text(_TEMPLATE)
    seen = {}

    class FakeEngine:
        def __init__(self, config: object) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    for value in (str(path), _TEMPLATE):
        llm_mod.LLM("x", chat_template=value)
        assert seen["config"].chat_template == _TEMPLATE
        args = build_parser().parse_args(["serve", "--chat-template", value])
        assert build_engine_config("x", **engine_kwargs(args)).chat_template == _TEMPLATE
    llm_mod.LLM("x")
    assert seen["config"].chat_template is None
    with pytest.raises(ValueError, match="^chat_template: Jinja syntax error"):
        llm_mod.LLM("x", chat_template="{{ x")


def test_a_strict_refusal_names_the_flag_that_lifts_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The strict-mode refusal said "use best effort (strict false)", the request field's
    words; on the command line it names ``--no-strict``, which then serves the schema."""
    schema = '{"type": "string", "not": {"pattern": "^a"}}'
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--json-schema",
                                            schema, "--grammar-backend", "xgrammar"])
    assert rc == 2 and "'not' is ignored" in err and "best effort (--no-strict)." in err, err
    assert "strict false" not in err and _FakeLLM.seen == []
    rc, _, err = _run(monkeypatch, capsys, ["generate", "--prompt", "hi", "--json-schema",
                                            schema, "--grammar-backend", "xgrammar",
                                            "--no-strict"])
    assert rc == 0, err


def test_json_records_name_the_grammar_backend() -> None:
    """``--output json`` records say which grammar backend served a request (``auto`` picks
    per schema), as the Python API and the server do; None without a grammar."""
    out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[2], text="{}",
                        finished=True, finish_reason=FinishReason.STOP,
                        grammar_backend="llguidance")
    assert out.to_dict()["grammar_backend"] == "llguidance"
    out.grammar_backend = None
    assert out.to_dict()["grammar_backend"] is None
