"""CLI flags that reach the engine config (``--kernels``, ``--load-format``), the checks of
``generate --batch`` lines, and the README's list of flags."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from structspec.cli import build_parser, main
from structspec.constraints import ChoiceConstraint, JsonSchemaConstraint, RegexConstraint
from structspec.core import SEED_MAX, SEED_MIN, FinishReason, RequestOutput, SamplingParams
from structspec.engine_args import engine_kwargs


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kernels_and_load_format_flags(command: str) -> None:
    from structspec.server.launch import build_engine_config

    extra = ["--prompt", "hi"] if command == "generate" else []
    parser = build_parser()
    args = parser.parse_args([command, *extra])
    kw = engine_kwargs(args)
    assert kw["kernels"] == "auto" and kw["load_format"] == "auto"
    args = parser.parse_args([command, *extra, "--kernels", "torch", "--load-format", "dummy",
                              "--no-cuda-graph"])
    kw = engine_kwargs(args)
    assert kw["kernels"] == "torch" and kw["load_format"] == "dummy"
    config = build_engine_config("some/dir", **kw)  # what `serve` hands the engine process
    assert (config.kernels, config.load_format, config.cuda_graph) == ("torch", "dummy", False)
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--load-format", "random"])
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--kernels", "cuda"])


def test_llm_passes_kernels_and_load_format(monkeypatch: pytest.MonkeyPatch) -> None:
    import structspec.llm as llm_mod

    seen = {}

    class FakeEngine:
        def __init__(self, config: object) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm_mod.LLM("x", kernels="torch", load_format="dummy", seed=5)
    config = seen["config"]
    assert (config.kernels, config.load_format, config.seed) == ("torch", "dummy", 5)


class _FakeLLM:
    """Stands in for :class:`structspec.llm.LLM` in ``generate --batch``: no model is loaded;
    a request whose parameters do not validate comes back as an error output, as in the
    engine."""

    seen: list[tuple[Any, SamplingParams]] = []
    #: the loaded model's vocabulary, as the CLI reads it (``--logit-bias`` ids)
    engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=49152))

    def __init__(self, model: str | None, **kwargs: Any) -> None:
        pass

    def generate(self, prompts: Any, params: list[SamplingParams] | SamplingParams,
                 **kwargs: Any) -> list[RequestOutput]:
        if isinstance(params, SamplingParams):  # one request (--prompt / --messages)
            prompts, params = [prompts], [params]
        outs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            _FakeLLM.seen.append((prompt, p))
            try:
                p.validate()
                if prompt == "":
                    raise ValueError("prompt is empty")  # as the engine refuses it
            except ValueError as e:
                outs.append(RequestOutput.error_output(f"req-{i}", str(e), "prompt"))
                continue
            outs.append(RequestOutput(request_id=f"req-{i}", prompt_token_ids=[1],
                                      token_ids=[2], text="ok", finished=True,
                                      finish_reason=FinishReason.STOP))
        return outs


def _run_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
               lines: list[Any]) -> tuple[int, list[dict[str, Any]], str]:
    """Runs ``generate --batch`` on ``lines`` (JSON values, or raw strings written as they
    are) with :class:`_FakeLLM`; returns the exit status, the JSONL records written and
    stderr."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join((rec if isinstance(rec, str) else json.dumps(rec)) + "\n"
                             for rec in lines))
    rc = main(["generate", "--batch", str(batch)])
    captured = capsys.readouterr()
    return rc, [json.loads(s) for s in captured.out.splitlines()], captured.err


def test_batch_good_lines_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys, [
        {"prompt": "a", "regex": "[0-9]+", "max_tokens": 4, "top_k": 3, "min_p": 0.1},
        {"messages": [{"role": "user", "content": "b"}], "json_schema": {"type": "object"},
         "strict": False, "seed": 1, "stop": "x", "temperature": 0.5, "top_p": 0.9},
        {"prompt": "c", "json_object": False, "choice": ["yes", "no"]},  # false: no grammar
    ])
    assert rc == 0 and err == "" and [o["text"] for o in outs] == ["ok", "ok", "ok"]
    assert [type(p.grammar) for _, p in _FakeLLM.seen] == [RegexConstraint, JsonSchemaConstraint, ChoiceConstraint]


@pytest.mark.parametrize("rec,words", [
    ({"prompt": "a", "json_schema": {"type": "object"}, "regex": "x"},
     ["json_schema", "regex"]),
    ({"prompt": "a", "ebnf": "root ::= \"x\"", "choice": ["x"]}, ["ebnf", "choice"]),
    ({"prompt": "a", "json_object": True, "regex": "x"}, ["json_object", "regex"]),
    ({"prompt": "a", "max_token": 5}, ["unknown", "max_token"]),
    ({"prompt": "a", "response_format": {"type": "json_object"}, "n": 2},
     ["unknown", "'n'", "'response_format'"]),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, ["prompt", "messages"]),
    (["not", "an", "object"], ["JSON object"]),
    ({"prompt": "a", "top_k": 2.5}, ["top_k", "integer"]),
    ({"prompt": "a", "seed": True}, ["seed", "integer"]),
    ({"prompt": "a", "temperature": "hot"}, ["temperature", "number"]),
    # malformed messages: refused before the model loads, naming the message field
    ({"messages": [{"role": "user", "content": 5}]},
     ["messages[0].content: expected a string or a list of text parts, got int"]),
    ({"messages": [{"role": "user"}]}, ["messages[0].content: missing"]),
    ({"messages": "hi"}, ["messages: expected a list of messages, got str"]),  # not a prompt
    ({"messages": []}, ["messages: expected at least one message"]),
])
def test_batch_bad_line_fails_alone_naming_line_and_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        rec: Any, words: list[str]) -> None:
    """A line with conflicting or unknown keys is that request's error (line number and keys
    named, on stderr and in its output record); the other lines still run."""
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys,
                               [{"prompt": "good"}, rec, {"prompt": "good too"}])
    assert rc == 1 and len(outs) == 3
    assert [o["text"] for o in (outs[0], outs[2])] == ["ok", "ok"]
    assert outs[1]["finish_reason"] == "abort"
    assert "batch.jsonl:2: bad record" in err
    for text in (err, outs[1]["error"]):
        assert "line 2" in text or "batch.jsonl:2" in text
        for word in words:
            assert word in text, (word, text)


def test_batch_top_k_is_not_truncated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``"top_k": 2.5`` in a batch line is an error, not silently ``int()``-ed to 2."""
    rc, outs, _ = _run_batch(tmp_path, monkeypatch, capsys,
                             [{"prompt": "a", "top_k": 2.5}, {"prompt": "b", "top_k": 2}])
    assert rc == 1 and outs[1]["error"] is None
    assert outs[0]["error"] is not None and "top_k" in outs[0]["error"]


def test_readme_cli_section_lists_every_flag() -> None:
    """README.md's CLI section names every flag of ``generate`` and ``serve``."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## CLI\n"):readme.index("\n## ", readme.index("## CLI\n"))]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {opt for command in sub.choices.values() for action in command._actions
             for opt in action.option_strings if opt.startswith("--") and opt != "--help"}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", section))
    assert not missing, f"README.md's CLI section lacks {missing}"


@pytest.mark.parametrize("flags,field", [(["--max-tokens", "0"], "--max-tokens: max_tokens"),
                                         (["--min-tokens", "300"],
                                          "--min-tokens: min_tokens must be in [0, max_tokens]"),
                                         (["--temperature", "nan"], "--temperature: temperature"),
                                         (["--request-seed", str(2**64)], "--request-seed: seed"),
                                         (["--request-seed", str(2**63)],
                                          "--request-seed: seed must be in [0, "),
                                         (["--request-seed", "-1"],
                                          "--request-seed: seed must be in [0, ")])
def test_bad_flag_value_is_a_bad_command_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              flags: list[str], field: str) -> None:
    """A flag value SamplingParams refuses exits 2 before any model loads (the fake LLM
    would record the call); the message names the flag, then the field."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    rc = main(["generate", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and field in err and err.startswith("structspec generate:")
    assert _FakeLLM.seen == []


@pytest.mark.parametrize("grammar", [["--regex", "a+"], ["--json-object"], []])
def test_no_strict_without_a_json_schema_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    grammar: list[str]) -> None:
    """``--no-strict`` only means something for ``--json-schema`` (and ``--structural-tag``);
    with another grammar (or none) it was ignored silently."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    rc = main(["generate", "--prompt", "hi", "--no-strict", *grammar])
    err = capsys.readouterr().err
    assert rc == 2 and "--no-strict: applies to --json-schema and --structural-tag only" in err, \
        err
    assert _FakeLLM.seen == []


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--seed", str(10**23)],
                                  ["generate", "--prompt", "hi", "--seed", "-1"],
                                  ["serve", "--port", "-1"], ["serve", "--port", "70000"]])
def test_out_of_range_int_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                argv: list[str]) -> None:
    """Engine seed and port are range-checked by argparse (exit 2 naming the flag); they used
    to fail later, with a traceback (port) or an error naming no flag (seed)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {argv[-2]}: {argv[-1]} is outside" in err, err


@pytest.mark.parametrize(("messages", "field"), [
    ([{"role": "system", "content": "x"}, {"role": "user"}], "messages[1].content: missing"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
     "messages[0].content[0].text: expected a string, got int"),
    ({"role": "user", "content": "hi"}, "messages: expected a list of messages, got dict"),
])
def test_malformed_messages_file_is_a_bad_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        messages: Any, field: str) -> None:
    """``--messages FILE`` with a malformed message exits 2 naming the flag and the field,
    before any model loads (a dict used to run its keys as two prompts)."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    rc = main(["generate", "--messages", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"structspec generate: --messages: {field}"), err
    assert _FakeLLM.seen == []


def test_messages_file_text_parts_reach_the_engine_joined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": [
        {"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]))
    assert main(["generate", "--messages", str(path)]) == 0
    assert [prompt for prompt, _ in _FakeLLM.seen] == [[{"role": "user", "content": "Say hi."}]]


def test_batch_line_that_is_not_json_or_refused_by_the_engine_fails_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A line that does not parse, and a line the engine refuses (empty prompt), fail alone;
    stderr names each one's line, counting the blank line."""
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys,
                               [{"prompt": "good"}, "not json", "", {"prompt": ""},
                                {"prompt": "good too"}])
    assert rc == 1 and [o["text"] for o in (outs[0], outs[3])] == ["ok", "ok"]
    assert "not JSON" in outs[1]["error"] and "line 2" in outs[1]["error"]
    assert outs[2]["error"] == "prompt is empty"
    assert "batch.jsonl:2: bad record: not JSON" in err
    assert "batch.jsonl:4: prompt is empty" in err


def test_every_batch_record_carries_its_input_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An error the engine reports (empty prompt) used to reach the output without its line
    (only stderr had it); now every record has ``line``, blank lines counted, and the good
    lines around the bad ones still succeed."""
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys,
                               [{"prompt": "good"}, "", {"prompt": ""}, {"prompt": "good too"},
                                {"prompt": "x", "top_k": -1}, "", {"prompt": "last"}])
    assert rc == 1
    assert [o["line"] for o in outs] == [1, 3, 4, 5, 7]
    assert [o["error"] for o in outs if o["line"] in (1, 4, 7)] == [None, None, None]
    assert [o["text"] for o in outs if o["line"] in (1, 4, 7)] == ["ok", "ok", "ok"]
    engine_refused, bad_record = outs[1], outs[3]
    assert engine_refused["error"] == "prompt is empty" and "batch.jsonl:3: prompt is empty" in err
    # the record carries the field and code the engine gave (the server's 400 has the same)
    assert (engine_refused["error_param"], engine_refused["error_code"]) == ("prompt", None)
    assert [(o["error_param"], o["error_code"]) for o in outs if o["line"] in (1, 4, 7)] == \
        [(None, None)] * 3
    assert bad_record["finish_reason"] == "abort" and "top_k" in bad_record["error"]
    assert (bad_record["error_param"], bad_record["error_code"]) == \
        ("top_k", "invalid_request_parameter")


@pytest.mark.parametrize(("line", "param", "code"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_request_parameter"),
    # refused as the --max-tokens flag refuses it (the flag exits 2 above 2**31 - 1)
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens", "invalid_request_parameter"),
    ({"prompt": "x", "temperature": -1}, "temperature", "invalid_request_parameter"),
    ({"prompt": "x", "stop": 5}, "stop", "invalid_request_parameter"),
    ({"prompt": "x", "regex": 5}, "regex", "invalid_request_parameter"),
    ({"prompt": "x", "json_schema": "object"}, "json_schema", "invalid_request_parameter"),
    ({"prompt": "x", "choice": []}, "choice", "invalid_request_parameter"),
    ({"prompt": "x", "strict": "yes", "json_object": True}, "strict",
     "invalid_request_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "invalid_request_parameter"),
    ({"prompt": [{"role": "user"}]}, "prompt", None),
    ({"prompt": [True]}, "prompt", None),
    ({"prompt": "x", "colour": 1}, None, None),  # the whole line: unknown key
    ("not json", None, None),
])
def test_a_bad_batch_record_names_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        line: Any, param: str | None, code: str | None) -> None:
    """A line the CLI refuses carries ``error_param`` / ``error_code`` as the Python API and
    the server name the same field (``invalid_request_parameter`` for any field but the
    prompt), beside a good line that still runs."""
    rc, outs, _ = _run_batch(tmp_path, monkeypatch, capsys, [line, {"prompt": "good"}])
    assert rc == 1 and outs[1]["error"] is None
    assert outs[0]["finish_reason"] == "abort" and outs[0]["error"]
    assert (outs[0]["error_param"], outs[0]["error_code"]) == (param, code)


class _GrammarCheckingLLM(_FakeLLM):
    """:class:`_FakeLLM` whose engine refuses a grammar as the real compile does: the grammar
    layer's tokenizer-free check, its :class:`GrammarError` becoming the output's error and
    ``error_param``."""

    def generate(self, prompts: Any, params: list[SamplingParams] | SamplingParams,
                 **kwargs: Any) -> list[RequestOutput]:
        from structspec.core import request_error_code
        from structspec.grammar.errors import GrammarError
        from structspec.grammar.precheck import check_grammar

        outs = super().generate(prompts, params, **kwargs)
        for i, p in enumerate(params if isinstance(params, list) else [params]):
            try:
                check_grammar(p.grammar)
            except GrammarError as e:
                outs[i] = RequestOutput.error_output(outs[i].request_id, str(e), e.param,
                                                     request_error_code(e.param, e.code))
        return outs


@pytest.mark.parametrize(("line", "param"), [
    ({"prompt": "x", "json_schema": {"type": "objectz"}}, "json_schema"),
    ({"prompt": "x", "regex": "(a"}, "regex"),
    ({"prompt": "x", "ebnf": 'root ::= "a'}, "ebnf"),
])
def test_a_grammar_the_engine_refuses_names_the_lines_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        line: dict[str, Any], param: str) -> None:
    """A line whose grammar the engine's compile refuses: its record's ``error_param`` is the
    line's key. An invalid JSON Schema used to say ``response_format.json_schema`` (the
    server's field) where a bad regex said ``regex``."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _GrammarCheckingLLM)
    _FakeLLM.seen = []
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps(line) + "\n" + json.dumps({"prompt": "good"}) + "\n")
    rc = main(["generate", "--batch", str(batch)])
    outs = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    assert rc == 1 and outs[1]["error"] is None
    assert outs[0]["finish_reason"] == "abort" and "Failed to compile" in outs[0]["error"]
    assert (outs[0]["error_param"], outs[0]["error_code"]) == (param,
                                                                "invalid_request_parameter")


def test_empty_prompt_is_a_bad_command_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--prompt ''`` used to load the model and exit 1 on the engine's refusal; the engine
    refuses an empty prompt (as vLLM does), so it is exit 2 before any model loads."""
    for extra in ([], ["--raw-prompt"]):
        rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "", *extra])
        assert rc == 2 and err.startswith("structspec generate: --prompt: the prompt is "
                                          "empty"), err
        assert _FakeLLM.seen == []
    rc, _, _ = _run_generate(monkeypatch, capsys, ["generate", "--prompt", " "])
    assert rc == 0 and [p for p, _ in _FakeLLM.seen] == [" "]  # whitespace is text


def test_request_seed_range_ends_are_served(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for seed in (SEED_MIN, SEED_MAX):
        rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi",
                                                         "--request-seed", str(seed)])
        assert rc == 0 and [p.seed for _, p in _FakeLLM.seen] == [seed], err


def test_batch_line_without_a_prompt_names_the_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys,
                               [{"regex": "a+"}, {"prompt": "good"}])
    assert rc == 1 and outs[1]["text"] == "ok"
    assert "no 'prompt' or 'messages'" in outs[0]["error"], outs[0]


def test_out_file_records_carry_the_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text('\n{"prompt": ""}\n{"prompt": "b"}\n')
    assert main(["generate", "--batch", str(batch), "--out-file", str(out)]) == 1
    records = [json.loads(s) for s in out.read_text().splitlines()]
    assert [(r["line"], r["error"]) for r in records] == [(2, "prompt is empty"), (3, None)]


def test_out_file_without_batch_is_a_bad_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    rc = main(["generate", "--prompt", "hi", "--out-file", str(tmp_path / "o.jsonl")])
    assert rc == 2 and "--out-file needs --batch" in capsys.readouterr().err
    assert _FakeLLM.seen == [] and not (tmp_path / "o.jsonl").exists()


def _run_generate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                  argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with :class:`_FakeLLM`; returns the exit status, stdout and stderr."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("flags,message", [
    (["--regex", ""], "--regex: empty pattern"),
    (["--json-schema", ""], "--json-schema: empty schema"),
    (["--json-schema", "  "], "--json-schema: empty schema"),
    (["--ebnf", ""], "--ebnf: empty"),
    (["--choice", ""], "--choice: empty choice"),
    (["--choice", "yes", ""], "--choice: empty choice"),
])
def test_empty_grammar_flag_is_a_bad_command_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flags: list[str], message: str) -> None:
    """An empty grammar value used to drop the constraint (``if args.regex:``) and run
    unconstrained with exit 0; now exit 2 naming the flag, before any model loads."""
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi", *flags])
    assert rc == 2 and err.startswith(f"structspec generate: {message}"), err
    assert _FakeLLM.seen == []


@pytest.mark.parametrize("flag,content", [("--ebnf", ""), ("--ebnf", " \n"),
                                          ("--json-schema", "\n")])
def test_empty_grammar_file_is_a_bad_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, content: str) -> None:
    path = tmp_path / "grammar.txt"
    path.write_text(content)
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi", flag,
                                                     str(path)])
    assert rc == 2 and err.startswith(f"structspec generate: {flag}: empty"), err
    assert _FakeLLM.seen == []


def test_batch_line_of_invalid_utf8_fails_alone_and_a_bom_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 on line 2 used to abort the whole batch (exit 2, no
    records); now that line fails alone with its line number. A BOM before line 1 is not
    part of line 1's JSON."""
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n{"prompt": "c"}\n')
    rc, out, err = _run_generate(monkeypatch, capsys, ["generate", "--batch", str(batch)])
    outs = [json.loads(s) for s in out.splitlines()]
    assert rc == 1 and [o["line"] for o in outs] == [1, 2, 3]
    assert [o["text"] for o in (outs[0], outs[2])] == ["ok", "ok"]
    assert outs[0]["error"] is None and outs[2]["error"] is None
    assert "line 2" in outs[1]["error"] and "not UTF-8" in outs[1]["error"]
    assert "batch.jsonl:2: bad record: not UTF-8" in err
    # where, as for a grammar file (Python's "'utf-8' codec can't decode" named neither)
    assert "not UTF-8: byte 0xff at column 13 cannot start a character" in outs[1]["error"]
    assert "codec" not in outs[1]["error"]
    assert [prompt for prompt, _ in _FakeLLM.seen if prompt] == ["a", "c"]


def test_batch_that_is_a_directory_is_a_bad_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--batch DIR`` used to end in an IsADirectoryError traceback (exit 1)."""
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--batch", str(tmp_path)])
    assert rc == 2 and err.startswith("structspec generate: --batch:"), err
    assert _FakeLLM.seen == []


@pytest.mark.parametrize("rec,words", [
    ({"prompt": "a", "choice": "abc"}, ["'choice'", "non-empty list", '"abc"']),
    ({"prompt": "a", "choice": ["a", 1, None]}, ["'choice'", "[\"a\", 1, null]"]),
    ({"prompt": "a", "choice": {"x": 1}}, ["'choice'"]),
    ({"prompt": "a", "choice": []}, ["'choice'"]),
    ({"prompt": "a", "regex": None}, ["'regex'", "non-empty string", "null"]),
    ({"prompt": "a", "regex": 123}, ["'regex'", "123"]),
    ({"prompt": "a", "regex": ""}, ["'regex'"]),
    ({"prompt": "a", "ebnf": None}, ["'ebnf'", "null"]),
    ({"prompt": "a", "ebnf": ["root ::= \"x\""]}, ["'ebnf'"]),
    ({"prompt": "a", "json_object": "false"}, ["'json_object'", "true or false", '"false"']),
    ({"prompt": "a", "json_schema": {}, "strict": "false"}, ["'strict'", '"false"']),
    ({"prompt": "a", "strict": 0}, ["'strict'"]),
    ({"prompt": "a", "json_schema": 5}, ["'json_schema'", "number"]),
    ({"prompt": "a", "json_schema": [{"type": "object"}]}, ["'json_schema'", "array"]),
    ({"prompt": [True, False]}, ["'prompt'", "token ids", "[true, false]"]),
    ({"prompt": None}, ["'prompt'", "null"]),
    ({"prompt": [1, "2"]}, ["'prompt'"]),
    ({"prompt": []}, ["'prompt'"]),
    ({"prompt": {"role": "user", "content": "a"}}, ["'prompt'"]),
    ({"prompt": [{"role": "user"}]}, ["'prompt'", "messages[0].content: missing"]),
])
def test_batch_field_of_the_wrong_type_is_refused_not_coerced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        rec: Any, words: list[str]) -> None:
    """``"abc"`` used to become the choices a/b/c, ``null`` the regex "None", ``"false"``
    a true ``strict``, ``[true, false]`` token ids; now the line fails alone, naming the line
    and the key."""
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys,
                               [{"prompt": "good"}, rec, {"prompt": "good too"}])
    assert rc == 1 and [o["text"] for o in (outs[0], outs[2])] == ["ok", "ok"]
    assert outs[1]["finish_reason"] == "abort"
    assert "batch.jsonl:2: bad record" in err
    for word in words:
        assert word in outs[1]["error"] and word in err, (word, outs[1]["error"])
    assert "line 2" in outs[1]["error"]


def test_batch_valid_field_forms_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The forms the type checks keep: token ids, a chat as 'prompt', boolean schemas,
    ``strict: false``, ``json_object: false``."""
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys, [
        {"prompt": [1, 2, 3]},
        {"prompt": [{"role": "user", "content": "hi"}], "choice": ["a", "b"]},
        {"prompt": "a", "json_schema": True},
        {"prompt": "a", "json_schema": {"type": "object"}, "strict": False},
        {"prompt": "a", "json_object": False, "regex": "x+"},
    ])
    assert rc == 0 and err == "" and [o["error"] for o in outs] == [None] * 5
    prompts = [prompt for prompt, _ in _FakeLLM.seen]
    assert prompts[:2] == [[1, 2, 3], [{"role": "user", "content": "hi"}]]
    grammars = [p.grammar for _, p in _FakeLLM.seen]
    assert grammars[1] == ChoiceConstraint(("a", "b")) and grammars[4] == RegexConstraint("x+")
    assert isinstance(grammars[2], JsonSchemaConstraint) and grammars[2].canonical_text() == "true"
    assert isinstance(grammars[3], JsonSchemaConstraint) and grammars[3].strict is False


@pytest.mark.parametrize("device", ["xyz", "", "mps", "meta", "cuda:", "cuda:x", "CPU"])
def test_bad_device_is_a_bad_command_line(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          device: str) -> None:
    """A device torch would parse (``mps``, ``meta``) or not (``xyz``) used to end in a
    traceback, exit 1; now exit 2 naming ``--device`` and the accepted forms, before any
    model loads."""
    rc, _, err = _run_generate(monkeypatch, capsys,
                               ["generate", "--prompt", "hi", "--device", device])
    assert rc == 2 and err.startswith("structspec generate: --device:"), err
    assert "cpu, cuda, cuda:N or auto" in err and _FakeLLM.seen == []


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda", "cuda:1"])
def test_good_device_passes_the_check(device: str) -> None:
    from structspec.config import check_device

    assert check_device(device) == device


def test_llm_device_none_is_a_value_error_naming_device() -> None:
    """``LLM(device=None)`` used to fail with an AttributeError (``None.startswith``)."""
    from structspec.llm import LLM

    with pytest.raises(ValueError, match=r"^device=None: expected cpu, cuda, cuda:N or auto"):
        LLM(device=None)  # type: ignore[arg-type]


def test_out_file_in_a_missing_directory_is_refused_before_the_batch_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It used to be found only when writing the results, after the whole batch ran."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "a"}\n')
    for out_file, words in [(tmp_path / "missing" / "o.jsonl", "does not exist"),
                            (tmp_path, "is a directory")]:
        rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--batch", str(batch),
                                                         "--out-file", str(out_file)])
        assert rc == 2 and err.startswith("structspec generate: --out-file:"), err
        assert words in err and _FakeLLM.seen == []


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_batch_invariant_flag(command: str) -> None:
    from structspec.server.launch import build_engine_config

    extra = ["--prompt", "hi"] if command == "generate" else []
    parser = build_parser()
    kw = engine_kwargs(parser.parse_args([command, *extra]))
    assert kw["batch_invariant"] is False
    assert build_engine_config("some/dir", **kw).batch_invariant is False
    kw = engine_kwargs(parser.parse_args([command, *extra, "--batch-invariant"]))
    assert kw["batch_invariant"] is True
    assert build_engine_config("some/dir", **kw).batch_invariant is True


def test_llm_passes_batch_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    import structspec.llm as llm_mod

    seen = {}

    class FakeEngine:
        def __init__(self, config: object) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm_mod.LLM("x", batch_invariant=True)
    assert seen["config"].batch_invariant is True
    llm_mod.LLM("x")
    assert seen["config"].batch_invariant is False


def test_flags_the_drafter_ignores_are_warned_about(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--num-draft-tokens`` without a drafter was accepted silently: the run goes on, and
    stderr says the flag has no effect."""
    import structspec.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", _FakeLLM)
    _FakeLLM.seen = []
    rc = main(["generate", "--prompt", "hi", "--num-draft-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 0 and len(_FakeLLM.seen) == 1
    assert ("structspec generate: warning: --num-draft-tokens has no effect with "
            "--speculative-algorithm none") in err
    main(["generate", "--prompt", "hi", "--speculative-algorithm", "ngram",
          "--num-draft-tokens", "16"])
    assert "warning" not in capsys.readouterr().err


def test_a_batch_line_names_its_first_bad_byte_by_column() -> None:
    """The column counts characters (not bytes) and not a line-1 BOM."""
    from structspec.cli import _utf8_error_in_line

    for raw, want in ((b'{"p": "\xc3\xa9\xff"}', "byte 0xff at column 9 cannot start"),
                      (b'\xef\xbb\xbf{"p": "\xff"}', "byte 0xff at column 8 cannot start"),
                      (b'{"p": "\xc3', "byte 0xc3 at column 8 starts a character the file")):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            assert _utf8_error_in_line(raw, e).startswith(want), _utf8_error_in_line(raw, e)
        else:
            raise AssertionError(raw)


def test_stop_text_flags_and_batch_keys_reach_the_params(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--include-stop-str-in-output`` / ``--no-skip-special-tokens`` and the ``--batch``
    keys ``include_stop_str_in_output`` / ``skip_special_tokens`` (a line's value wins; a
    non-boolean fails the line naming the key)."""
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi"])
    assert rc == 0, err
    p = _FakeLLM.seen[-1][1]
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    rc, _, err = _run_generate(monkeypatch, capsys, [
        "generate", "--prompt", "hi", "--stop", "x", "--include-stop-str-in-output",
        "--no-skip-special-tokens"])
    assert rc == 0, err
    p = _FakeLLM.seen[-1][1]
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys, [
        {"prompt": "a", "include_stop_str_in_output": True, "skip_special_tokens": False},
        {"prompt": "b"},
        {"prompt": "c", "include_stop_str_in_output": "yes"},
        {"prompt": "d", "skip_special_tokens": 0},
    ])
    assert rc == 1 and [o["error"] is None for o in outs] == [True, True, False, False]
    seen = [(p.include_stop_str_in_output, p.skip_special_tokens) for _, p in _FakeLLM.seen]
    assert seen[:2] == [(True, False), (False, True)]  # (the bad lines run as placeholders)
    assert outs[2]["error_param"] == "include_stop_str_in_output"
    assert outs[3]["error_param"] == "skip_special_tokens"
    assert "include_stop_str_in_output must be True or False" in outs[2]["error"]
