"""Nothing in a request is dropped without a word (issue 17): fields the server knows but does
not implement are a 400 ``unsupported`` naming them, unknown keys inside the objects it reads
are a 400 naming them, unknown top-level fields are logged (vLLM's behaviour), booleans are
never coerced, and a seed has one range. Fake engine, no model."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.core import SEED_MAX
from structspec.server.field_policy import NO_EFFECT, UNSUPPORTED
from tests.server.fake_client import CHAT, COMPLETIONS, SCHEMA, post
from tests.server.server_fakes import FakeEngine


def error_of(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    err: dict[str, Any] = r.json()["error"]
    return err


# ------------------------------------------------------------------ unknown nested keys


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "stirct": True}}}, "response_format.json_schema.stirct"),
    (CHAT, {"response_format": {"type": "json_object", "shcema": SCHEMA}},
     "response_format.shcema"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "usage": True}},
     "stream_options.usage"),
])
def test_unknown_key_of_a_known_object_is_400_naming_it(client: TestClient, path: str,
                                                        body: dict[str, Any],
                                                        param: str) -> None:
    err = error_of(post(client, path, **body))
    assert err["param"] == param and f"unknown field {param}" in err["message"], err


@pytest.mark.parametrize(("rf", "param"), [
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}, "regex": "a"},
     "response_format.regex"),  # a key its type does not read would be ignored
    ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "regex", "regex": "a", "pattern": "b"}, "response_format.pattern"),
    ({"type": "choice", "choices": ["a"], "choice": ["b"]}, "response_format.choice"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}, "schema": {"type": "string"}},
     "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True},
      "strict": False}, "response_format.strict"),
    ({"type": "json_object", "strict": True}, "response_format.strict"),
])
def test_response_format_key_that_would_be_ignored_is_400(client: TestClient,
                                                          rf: dict[str, Any],
                                                          param: str) -> None:
    assert error_of(post(client, CHAT, response_format=rf))["param"] == param


def test_null_keys_ask_for_nothing(client: TestClient) -> None:
    r = post(client, CHAT, structured_outputs={"regex": "a+", "whitespace_pattern": None},
             response_format=None, stream_options=None)
    assert r.status_code == 200, r.text
    r = post(client, CHAT, response_format={"type": "json_schema", "regex": None,
                                            "json_schema": {"schema": SCHEMA, "x": None}})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ known, not implemented


def _bad_value(name: str) -> Any:
    """A value of ``name`` that asks for something the server does not do."""
    return {"functions": [{"name": "f", "parameters": {}}], "function_call": {"name": "f"},
            "parallel_tool_calls": False, "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"}, "store": True,
            "service_tier": "flex", "logit_bias": {"5": 1.0}, "suffix": "end", "best_of": 3,
            "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2,
            "length_penalty": 0.5, "min_tokens": 5, "use_beam_search": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "echo": True, "add_generation_prompt": False,
            "continue_final_message": True}.get(name, "x")


def _cases() -> list[Any]:
    return [pytest.param(path, e.name, id=f"{endpoint}-{e.name}")
            for e in UNSUPPORTED
            for path, endpoint in ((CHAT, "chat"), (COMPLETIONS, "completions"))
            if endpoint in e.endpoints]


@pytest.mark.parametrize(("path", "name"), _cases())
def test_field_the_server_does_not_implement_is_400_unsupported(client: TestClient,
                                                                path: str, name: str) -> None:
    err = error_of(post(client, path, **{name: _bad_value(name)}))
    assert err["param"] == name and err["code"] == "unsupported", err
    assert name in err["message"] and "accepted:" in err["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("body", [
    {"include_stop_str_in_output": True, "skip_special_tokens": False},
    {"include_stop_str_in_output": False, "skip_special_tokens": True},
    {"include_stop_str_in_output": None, "skip_special_tokens": None},
])
def test_served_vllm_text_options_are_accepted(engine: FakeEngine, client: TestClient,
                                               path: str, body: dict[str, Any]) -> None:
    """vLLM's include_stop_str_in_output and skip_special_tokens were refused as
    unsupported; they are served now (``null``: the defaults, false and true)."""
    assert all(e.name not in body for e in UNSUPPORTED)
    r = post(client, path, **body)
    assert r.status_code == 200, r.text
    params = engine.added[-1][2]
    assert params.include_stop_str_in_output is bool(body["include_stop_str_in_output"])
    assert params.skip_special_tokens is (body["skip_special_tokens"] is not False)


@pytest.mark.parametrize("body", [
    {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "store": False,
     "modalities": ["text"], "service_tier": "auto", "parallel_tool_calls": True,
     "function_call": "none", "functions": [], "min_tokens": 0, "skip_special_tokens": True,
     "include_stop_str_in_output": False, "echo": False, "priority": 0,
     "reasoning_effort": None, "audio": None},
])
def test_values_that_ask_for_nothing_are_accepted(client: TestClient,
                                                  body: dict[str, Any]) -> None:
    assert post(client, CHAT, **body).status_code == 200
    assert post(client, COMPLETIONS, suffix="", best_of=1, presence_penalty=0,
                min_tokens=0).status_code == 200


# ------------------------------------------------------------------ unknown top-level


def test_unknown_top_level_fields_are_accepted_and_logged(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="structspec.server"):
        r = post(client, CHAT, frobnicate=1, **{"x" * 100: True})
    assert r.status_code == 200, r.text
    warned = [rec.getMessage() for rec in caplog.records if "ignored unknown" in
              rec.getMessage()]
    assert len(warned) == 1 and "'frobnicate'" in warned[0], warned
    assert "x" * 41 not in warned[0]  # a long name is cut
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="structspec.server"):
        r = post(client, COMPLETIONS, **{name: "id-1" if name != "metadata" else {"k": "v"}
                                         for name in NO_EFFECT})
    assert r.status_code == 200, r.text
    assert not [rec for rec in caplog.records if "ignored unknown" in rec.getMessage()]


# ------------------------------------------------------------------ booleans, stream options


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": "no"}}}, "response_format.json_schema.strict"),
    (CHAT, {"stream": "false"}, "stream"),
    (COMPLETIONS, {"echo": "no"}, "echo"),
    (CHAT, {"logprobs": "yes"}, "logprobs"),
    (COMPLETIONS, {"ignore_eos": 1}, "ignore_eos"),
    (CHAT, {"include_stop_str_in_output": "true"}, "include_stop_str_in_output"),
    (COMPLETIONS, {"skip_special_tokens": 0}, "skip_special_tokens"),
    (CHAT, {"spaces_between_special_tokens": "false"}, "spaces_between_special_tokens"),
    (COMPLETIONS, {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    (CHAT, {"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    (COMPLETIONS, {"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    (CHAT, {"structured_outputs": {"json_object": "no"}}, "structured_outputs.json_object"),
    (CHAT, {"stream": True, "stream_options": {"include_obfuscation": "no"}},
     "stream_options.include_obfuscation"),
])
def test_booleans_are_never_coerced(client: TestClient, path: str, body: dict[str, Any],
                                    param: str) -> None:
    assert error_of(post(client, path, **body))["param"] == param


def test_stream_options_need_a_stream(client: TestClient) -> None:
    """OpenAI and vLLM refuse stream_options on a request that does not stream."""
    for path in (CHAT, COMPLETIONS):
        err = error_of(post(client, path, stream_options={"include_usage": True}))
        assert err["param"] == "stream_options", err
    r = post(client, CHAT, stream=False, stream_options=None)
    assert r.status_code == 200, r.text


def test_stream_options_the_stream_does_not_follow_are_refused(client: TestClient) -> None:
    err = error_of(post(client, CHAT, stream=True, stream_options={"include_obfuscation": True}))
    assert err["param"] == "stream_options.include_obfuscation" and err["code"] == "unsupported"
    r = post(client, CHAT, stream=True, stream_options={"include_usage": True,
                                                        "include_obfuscation": False,
                                                        "continuous_usage_stats": False})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ seed


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**64, -(2**63)])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_seed_outside_the_one_range_is_400(client: TestClient, path: str, seed: int) -> None:
    err = error_of(post(client, path, seed=seed))
    assert err["param"] == "seed" and "seed must be in [0, 9223372036854775807]" in \
        err["message"], err


def test_seed_range_ends_are_served_and_choices_wrap(client: TestClient,
                                                     engine: FakeEngine) -> None:
    assert post(client, CHAT, seed=0).status_code == 200
    r = post(client, COMPLETIONS, seed=SEED_MAX, n=3)
    assert r.status_code == 200, r.text
    assert [p.seed for _, _, p in engine.added[-3:]] == [SEED_MAX, 0, 1]


# ------------------------------------------------------------------ priority (issue 21)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_priority_reaches_the_engine_for_every_choice(client: TestClient, engine: FakeEngine,
                                                      path: str) -> None:
    assert post(client, path, priority=-3, n=2).status_code == 200
    assert post(client, path, priority=None).status_code == 200  # null: the default
    assert engine.priorities == [-3, -3, 0]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value", ["high", 1.5, True, [1], {"level": 1}])
def test_priority_that_is_not_an_int_is_400_naming_it(client: TestClient, engine: FakeEngine,
                                                      path: str, value: Any) -> None:
    err = error_of(post(client, path, priority=value))
    assert err["param"] == "priority", err
    assert not engine.added
