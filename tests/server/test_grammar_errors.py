"""Grammar refusals as HTTP errors: ``grammar_too_complex`` keeps its code and names the
field the client used; a misread regex is a 400 from the front end; compile time-limit stops
are counted in ``/metrics`` (issue 17)."""

from __future__ import annotations

import pytest

from structspec.server.errors import APIError
from structspec.server.generation import error_for
from structspec.server.ipc import EngineDelta, EngineStats
from structspec.server.metrics import ServerMetrics
from structspec.server.protocol import CompletionRequest, parse_request
from structspec.server.structured import grammar_and_field

TIMEOUT_MESSAGE = ("the choice grammar did not finish compiling within the 30 s limit "
                   "(grammar_compile_timeout_s) and was stopped; simplify it")


@pytest.mark.parametrize("engine_param, client_field", [
    ("choice", "choice"),
    ("choice", "guided_choice"),
    ("json_schema", "json_schema"),
    ("json_schema", "response_format.json_schema"),
    ("json_schema", "guided_json"),
    ("regex", "response_format.regex"),
])
def test_grammar_too_complex_keeps_its_code_and_names_the_client_field(
        engine_param: str, client_field: str) -> None:
    delta = EngineDelta(request_id="r", finished=True, finish_reason="abort",
                        error=TIMEOUT_MESSAGE, error_param=engine_param,
                        error_code="grammar_too_complex")
    err = error_for(delta, client_field)
    assert err.status == 400 and err.code == "grammar_too_complex"
    assert err.param == client_field and "30 s limit" in err.message


def test_other_grammar_errors_keep_the_generic_code() -> None:
    delta = EngineDelta(request_id="r", finished=True, finish_reason="abort",
                        error="Failed to compile regex grammar: x", error_param="regex")
    assert error_for(delta, "regex").code == "invalid_request_parameter"


@pytest.mark.parametrize("body, param", [
    ({"regex": "\\q"}, "regex"),
    ({"guided_regex": "a[^]"}, "guided_regex"),
    ({"response_format": {"type": "regex", "regex": "[]x"}}, "response_format.regex"),
    ({"structured_outputs": {"regex": "\\z"}}, "structured_outputs.regex"),
])
def test_misread_regex_is_a_400_naming_the_field(body: dict, param: str) -> None:
    req = parse_request(CompletionRequest, {"prompt": "x", **body})
    with pytest.raises(APIError) as info:
        grammar_and_field(req)
    assert info.value.status == 400 and info.value.param == param
    assert "is not a usable regex" in info.value.message


def test_compile_timeouts_are_exported() -> None:
    metrics = ServerMetrics()
    metrics.on_engine_stats(EngineStats(grammar_compile_s=(0.5, 12.0),
                                        grammar_compile_timeouts=2))
    metrics.on_engine_stats(EngineStats(grammar_compile_timeouts=1))
    text = metrics.render().decode()
    assert "structspec_grammar_compile_timeouts_total 3.0" in text
    assert "structspec_grammar_compile_seconds_count 2.0" in text
