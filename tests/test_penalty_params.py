"""The penalty, logit-bias and repetition-stop fields (issue 20) in the Python API and the
CLI: normalised at construction, refused by ``validate`` / the command line naming the field
or flag, carried to the engine from the flags and ``--batch`` lines."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from structspec.constraints import JsonObjectConstraint, JsonSchemaConstraint
from structspec.core import SamplingParams
from structspec.penalty_params import (
    RepetitionStop,
    logit_bias_from_json,
    repetition_stop_from_json,
)
from tests.test_cli import _FakeLLM, _run_batch, _run_generate


def test_construction_normalises() -> None:
    bias = {5: -1.0}
    p = SamplingParams(logit_bias=bias, repetition_stop=True)
    bias[6] = 2.0  # the caller's dict changes later: the params do not
    assert p.logit_bias == {5: -1.0} and p.repetition_stop == RepetitionStop()
    assert SamplingParams(logit_bias={}, repetition_stop=False).logit_bias is None
    assert SamplingParams(repetition_stop=False).repetition_stop is None
    assert not SamplingParams().has_penalties
    for kw in (dict(presence_penalty=0.1), dict(frequency_penalty=-2), dict(logit_bias={1: 0}),
               dict(repetition_penalty=1.01)):
        assert SamplingParams(**kw).has_penalties  # type: ignore[arg-type]
        SamplingParams(**kw).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "field"), [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-math.inf), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=101.0), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: math.nan}), "logit_bias"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(repetition_stop=RepetitionStop(min_tokens=1)), "repetition_stop.min_tokens"),
    (dict(repetition_stop=RepetitionStop(max_period=0)), "repetition_stop.max_period"),
    (dict(repetition_stop=RepetitionStop(min_repeats=2.5)), "repetition_stop.min_repeats"),
    (dict(repetition_stop="yes"), "repetition_stop"),
])
def test_validate_names_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw).validate()  # type: ignore[arg-type]
    assert str(e.value).startswith(field), e.value


def test_json_forms() -> None:
    assert logit_bias_from_json({"5": -1, "17": 2.5}) == {5: -1, 17: 2.5}
    assert logit_bias_from_json(None) is None
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, [1], {"5": 1, "05": -1}):
        with pytest.raises(ValueError, match="logit_bias"):
            logit_bias_from_json(bad)
    assert repetition_stop_from_json(True) == RepetitionStop()
    assert repetition_stop_from_json({"min_tokens": 10}) == RepetitionStop(min_tokens=10)
    assert repetition_stop_from_json(False) is None and repetition_stop_from_json(None) is None
    for bad, where in (({"period": 2}, "repetition_stop.period"), ("on", "repetition_stop"),
                       ({"max_period": 1000}, "repetition_stop.max_period")):
        with pytest.raises(ValueError) as e:
            repetition_stop_from_json(bad)
        assert str(e.value).startswith(where)


def test_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bias = tmp_path / "bias.json"
    bias.write_text('{"28": -100}')
    rc, _, err = _run_generate(monkeypatch, capsys, [
        "generate", "--prompt", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "-1",
        "--repetition-penalty", "1.2", "--logit-bias", str(bias), "--stop-on-repeat",
        "--json-object", "--unbounded-numbers"])
    assert rc == 0, err
    (_, p), = _FakeLLM.seen
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1, 1.2)
    assert p.logit_bias == {28: -100} and p.repetition_stop == RepetitionStop()
    assert p.grammar == JsonObjectConstraint(bounded_numbers=False)
    rc, _, _ = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi",
                                                   "--stop-on-repeat", "20",
                                                   "--logit-bias", '{"3": 1}'])
    (_, p), = _FakeLLM.seen
    assert rc == 0 and p.repetition_stop == RepetitionStop(min_tokens=20)
    assert p.logit_bias == {3: 1} and p.grammar is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--presence-penalty", "3"], "--presence-penalty: presence_penalty"),
    (["--repetition-penalty", "nan"], "--repetition-penalty: repetition_penalty"),
    (["--logit-bias", "{5: 1}"], "--logit-bias: not a JSON object"),
    (["--logit-bias", '{"a": 1}'], "--logit-bias: logit_bias key 'a'"),
    (["--logit-bias", "/nonexistent/bias.json"], "--logit-bias: no such file"),
    (["--logit-bias", '{"1": 500}'], "--logit-bias: logit_bias[1]"),
    (["--stop-on-repeat", "1"], "--stop-on-repeat: repetition_stop.min_tokens"),
    (["--unbounded-numbers"], "--unbounded-numbers: applies to a JSON Schema"),
    (["--unbounded-numbers", "--regex", "a+"], "--unbounded-numbers: applies to a JSON"),
])
def test_bad_flags_are_a_bad_command_line(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          flags: list[str], message: str) -> None:
    rc, _, err = _run_generate(monkeypatch, capsys, ["generate", "--prompt", "hi", *flags])
    assert rc == 2 and message in err, err
    assert _FakeLLM.seen == []


def test_batch_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    schema = {"type": "object"}
    rc, outs, err = _run_batch(tmp_path, monkeypatch, capsys, [
        {"prompt": "a", "presence_penalty": 1, "frequency_penalty": 0.5,
         "repetition_penalty": 1.1, "logit_bias": {"7": -3}, "repetition_stop": {"min_tokens": 9}},
        {"prompt": "b", "json_schema": schema, "bounded_numbers": False,
         "repetition_stop": True},
        {"prompt": "c", "json_schema": schema},
        {"prompt": "d", "bounded_numbers": False},  # no JSON grammar: this line fails alone
        {"prompt": "e", "logit_bias": {"7": "x"}},
    ])
    assert rc == 1
    assert [o["error"] is None for o in outs] == [True, True, True, False, False]
    assert "bounded_numbers" in outs[3]["error"] and "logit_bias" in outs[4]["error"]
    p = [p for _, p in _FakeLLM.seen]
    assert (p[0].presence_penalty, p[0].frequency_penalty, p[0].repetition_penalty) == (
        1, 0.5, 1.1)
    assert p[0].logit_bias == {7: -3} and p[0].repetition_stop == RepetitionStop(min_tokens=9)
    assert p[1].grammar == JsonSchemaConstraint(schema, bounded_numbers=False)
    assert p[1].repetition_stop == RepetitionStop()
    assert p[2].grammar == JsonSchemaConstraint(schema)
    assert "line" in outs[3] and err
