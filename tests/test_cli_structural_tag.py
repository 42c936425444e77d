"""``structspec generate --structural-tag`` and the ``structural_tag`` key of ``--batch``
lines: the constraint they build, and their refusals, each naming the flag or key and the
place in the tag (no model: the CLI's fake LLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from structspec.constraints import StructuralTagConstraint
from tests.test_cli import _FakeLLM, _run_batch, _run_generate

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                          "end": "</function>"}], "triggers": ["<function="]}
CURRENT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<function="],
    "tags": [{"begin": "<function=get_weather>",
              "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "</function>"}]}}
DATED = {"structures": [{"begin": "<d>", "schema": {"type": "object", "properties": {
    "x": {"type": "string", "format": "date"}}}, "end": "</d>"}], "triggers": ["<d"]}


def _generate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              *flags: str) -> tuple[int, str]:
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi", *flags])
    return rc, err


@pytest.mark.parametrize("tag", [LEGACY, CURRENT])
def test_the_flag_takes_inline_json_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              tag: dict[str, Any]) -> None:
    rc, err = _generate(monkeypatch, capsys, "--structural-tag", json.dumps(tag))
    assert rc == 0, err
    assert _FakeLLM.seen[-1][1].grammar == StructuralTagConstraint(tag)
    path = tmp_path / "tag.json"
    path.write_text(json.dumps(tag))
    rc, err = _generate(monkeypatch, capsys, "--structural-tag", str(path), "--no-strict",
                        "--unbounded-numbers")
    assert rc == 0, err
    assert _FakeLLM.seen[-1][1].grammar == StructuralTagConstraint(tag, strict=False,
                                                                   bounded_numbers=False)


@pytest.mark.parametrize("flags, message", [
    (["--structural-tag", " "], "--structural-tag: empty structural tag"),
    (["--structural-tag", "tags/missing.json"], "--structural-tag: no such file"),
    (["--structural-tag", "{oops"], "--structural-tag: inline JSON is not valid JSON"),
    (["--structural-tag", "[]"], "--structural-tag must be a structural tag object"),
    (["--structural-tag", "[1,"], "--structural-tag: inline JSON is not valid JSON"),
    (["--structural-tag", json.dumps({**LEGACY, "triggers": ["<tool"]})],
     "--structural-tag.structures[0].begin: begin '<function=get_weather>' starts with no "
     "trigger"),
    (["--structural-tag", json.dumps({"format": {"type": "any_text", "limit": 3}})],
     "--structural-tag.format.limit: unknown key 'limit'"),
    # the engine's strict check, before the model loads (and how to turn it off, as a flag)
    (["--structural-tag", json.dumps(DATED)],
     "--structural-tag: structural_tag: the JSON Schema at structures[0].schema cannot be "
     "enforced exactly in strict mode: structures[0].schema/properties/x"),
    (["--structural-tag", json.dumps(LEGACY), "--grammar-backend", "llguidance"],
     "--structural-tag: structural_tag grammars are served by xgrammar only"),
])
def test_a_bad_flag_is_a_bad_command_line(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          flags: list[str], message: str) -> None:
    rc, err = _generate(monkeypatch, capsys, *flags)
    assert rc == 2 and err.startswith(f"structspec generate: {message}"), err
    assert _FakeLLM.seen == []


def test_strict_refusal_says_how_to_lift_it_and_auto_uses_xgrammar(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _generate(monkeypatch, capsys, "--structural-tag", json.dumps(DATED),
                        "--grammar-backend", "auto")
    assert rc == 2 and "pass --no-strict" in err and "llguidance" not in err, err
    rc, err = _generate(monkeypatch, capsys, "--structural-tag", json.dumps(DATED),
                        "--no-strict", "--grammar-backend", "auto")
    assert rc == 0, err


def test_batch_lines_take_a_structural_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys, [
        {"prompt": "a", "structural_tag": LEGACY},
        {"prompt": "b", "structural_tag": CURRENT, "strict": False, "bounded_numbers": False},
        {"prompt": "c", "structural_tag": json.dumps(LEGACY)},
        {"prompt": "d", "structural_tag": {**LEGACY, "structures": []}},
        {"prompt": "e", "structural_tag": LEGACY, "regex": "a"},
    ])
    assert rc == 1, err
    grammars = [p.grammar for _, p in _FakeLLM.seen]
    assert grammars[:2] == [StructuralTagConstraint(LEGACY),
                            StructuralTagConstraint(CURRENT, strict=False,
                                                    bounded_numbers=False)]
    assert [o["error"] is None for o in outs] == [True, True, False, False, False]
    assert outs[2]["error_param"] == "structural_tag" and "object" in outs[2]["error"]
    assert outs[3]["error_param"] == "structural_tag.structures"
    assert "more than one grammar key" in outs[4]["error"]


def test_long_inline_json_is_not_taken_for_a_path(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Inline JSON with a part over the file system's name limit (255 bytes between two
    slashes) used to end ``generate`` with an ``OSError`` traceback (File name too long)."""
    schema = {"type": "object", "description": "x" * 300 + "/y",
              "properties": {"a": {"type": "string"}}}
    rc, err = _generate(monkeypatch, capsys, "--json-schema", json.dumps(schema))
    assert rc == 0, err
