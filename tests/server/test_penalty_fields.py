"""The server's sampling penalties, logit bias, allowed token ids, bad words, repetition stop
and number-bound option (issue 20): served values reach the engine, bad ones are a 400 naming
the field. Fake engine, no model."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from structspec.constraints import JsonSchemaConstraint
from structspec.penalty_params import RepetitionStop
from tests.server.fake_client import CHAT, COMPLETIONS, MSGS, SCHEMA, post
from tests.server.server_fakes import FakeEngine


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_penalties_reach_the_engine(client: TestClient, engine: FakeEngine, path: str) -> None:
    r = post(client, path, presence_penalty=0.5, frequency_penalty=-2, repetition_penalty=1.2,
             logit_bias={"5": -100, "7": 2.5}, repetition_stop={"min_tokens": 20}, n=2)
    assert r.status_code == 200, r.text
    for _, _, p in engine.added[-2:]:
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -2, 1.2)
        assert p.logit_bias == {5: -100, 7: 2.5}
        assert p.repetition_stop == RepetitionStop(min_tokens=20)
    assert post(client, path, repetition_stop=True).status_code == 200
    assert engine.added[-1][2].repetition_stop == RepetitionStop()
    assert post(client, path, allowed_token_ids=[5, 72, 101]).status_code == 200
    assert engine.added[-1][2].allowed_token_ids == (5, 72, 101)
    assert engine.added[-1][2].has_penalties
    assert post(client, path, bad_words=["big dog", " cat"]).status_code == 200
    assert engine.added[-1][2].bad_words == ("big dog", " cat")
    assert post(client, path, bad_words=[]).status_code == 200  # asks for nothing
    assert engine.added[-1][2].bad_words is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("body", "param"), [
    ('{"presence_penalty": NaN}', "presence_penalty"),
    ('{"frequency_penalty": -Infinity}', "frequency_penalty"),
    ('{"presence_penalty": 2.01}', "presence_penalty"),
    ('{"frequency_penalty": -3}', "frequency_penalty"),
    ('{"repetition_penalty": 0}', "repetition_penalty"),
    ('{"repetition_penalty": NaN}', "repetition_penalty"),
    ('{"logit_bias": {"5": 100.5}}', "logit_bias"),
    ('{"logit_bias": {"5": NaN}}', "logit_bias"),
    ('{"logit_bias": {"abc": 1}}', "logit_bias"),
    ('{"logit_bias": {"-3": 1}}', "logit_bias"),
    ('{"logit_bias": {"2000000": 1}}', "logit_bias"),  # the fake's vocabulary is 0x110000
    (json.dumps({"logit_bias": {str(t): 1 for t in range(301)}}), "logit_bias"),
    ('{"allowed_token_ids": []}', "allowed_token_ids"),
    ('{"allowed_token_ids": [2000000]}', "allowed_token_ids"),
    ('{"allowed_token_ids": [-1]}', "allowed_token_ids"),
    ('{"allowed_token_ids": ["5"]}', "allowed_token_ids[0]"),
    ('{"bad_words": "word"}', "bad_words"),
    ('{"bad_words": ["ok", 3]}', "bad_words[1]"),
    ('{"bad_words": ["ok", ""]}', "bad_words"),
    ('{"bad_words": [" "]}', "bad_words"),
    (json.dumps({"bad_words": ["w"] * 129}), "bad_words"),
    (json.dumps({"bad_words": ["x" * 257]}), "bad_words"),
    ('{"repetition_stop": {"min_tokens": 1}}', "repetition_stop"),
    ('{"repetition_stop": {"max_period": 10000}}', "repetition_stop"),
    ('{"repetition_stop": {"period": 3}}', "repetition_stop"),
])
def test_bad_values_are_400_naming_the_field(client: TestClient, path: str, body: str,
                                             param: str) -> None:
    base = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    text = json.dumps(base)[:-1] + ", " + body[1:]  # NaN / Infinity are not json.dumps'
    r = client.post(path, content=text, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"]


def test_bounded_numbers_option(client: TestClient, engine: FakeEngine) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert post(client, CHAT, response_format=rf).status_code == 200
    assert engine.added[-1][2].grammar == JsonSchemaConstraint(SCHEMA, strict=False)
    r = post(client, CHAT, response_format=rf, structured_outputs={"bounded_numbers": False})
    assert r.status_code == 200, r.text
    g = engine.added[-1][2].grammar
    assert isinstance(g, JsonSchemaConstraint) and not g.bounded_numbers
    r = post(client, COMPLETIONS, structured_outputs={"json_object": True,
                                                      "bounded_numbers": False})
    assert r.status_code == 200 and not engine.added[-1][2].grammar.bounded_numbers
    r = post(client, CHAT, regex="a+", structured_outputs={"bounded_numbers": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == (
        "structured_outputs.bounded_numbers")
