"""Structural tags on the server: ``response_format: {"type": "structural_tag", ...}`` (xgrammar's
current form and vLLM's legacy one) and ``structured_outputs.structural_tag`` (JSON text or an
object) map to one :class:`StructuralTagConstraint`; bad input is a 400 naming the field (the
place in the tag), the engine's strict refusal too; never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.constraints import StructuralTagConstraint
from structspec.server.generation import request_param
from tests.server.fake_client import CHAT, COMPLETIONS, post
from tests.server.server_fakes import FakeEngine

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STRUCTURES = [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]
TRIGGERS = ["<function="]
FORMAT = {"type": "triggered_tags", "triggers": TRIGGERS,
          "tags": [{"begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": WEATHER},
                    "end": "</function>"}]}
CURRENT = {"type": "structural_tag", "format": FORMAT}
LEGACY = {"structures": STRUCTURES, "triggers": TRIGGERS}
DATED = {"type": "object", "properties": {"x": {"type": "string", "format": "date"}}}


@pytest.mark.parametrize("body, tag, strict", [
    ({"response_format": CURRENT}, CURRENT, False),
    ({"response_format": {"type": "structural_tag", **LEGACY}},
     {"type": "structural_tag", **LEGACY}, False),
    ({"response_format": {**CURRENT, "strict": True}}, CURRENT, True),
    ({"structured_outputs": {"structural_tag": json.dumps(LEGACY)}}, LEGACY, False),
    ({"structured_outputs": {"structural_tag": CURRENT}}, CURRENT, False),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_each_form_maps_to_the_constraint(client: TestClient, engine: FakeEngine, path: str,
                                          body: dict[str, Any], tag: dict[str, Any],
                                          strict: bool) -> None:
    r = post(client, path, max_tokens=100, **body)
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].grammar == StructuralTagConstraint(tag, strict=strict)
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert "<function=get_weather>" in text
    assert "schema_valid" not in choice  # no verdict for a structural tag


def test_bounded_numbers_false_lifts_the_tags_bounds(client: TestClient,
                                                     engine: FakeEngine) -> None:
    r = post(client, CHAT, response_format=CURRENT,
             structured_outputs={"bounded_numbers": False})
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].grammar == StructuralTagConstraint(CURRENT, strict=False,
                                                                  bounded_numbers=False)


@pytest.mark.parametrize("body, param, fragment", [
    # not an object / not JSON
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag",
     "not valid JSON"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs.structural_tag",
     "must be a structural tag object"),
    ({"structured_outputs": {"structural_tag": 5}}, "structured_outputs.structural_tag",
     "must be a structural tag object"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs 'format'"),
    ({"response_format": {"type": "structural_tag", "format": 3}}, "response_format.format",
     "must be a JSON object"),
    # unknown keys, in response_format and inside the tag
    ({"response_format": {**CURRENT, "formats": {}}}, "response_format.formats", "formats"),
    ({"response_format": {**CURRENT, "regex": "a"}}, "response_format.regex", "does not take"),
    ({"response_format": {"type": "structural_tag", "triggers": TRIGGERS,
                          "structures": [{**STRUCTURES[0], "strict": True}]}},
     "response_format.structures[0].strict", "unknown key 'strict'"),
    ({"structured_outputs": {"structural_tag": {**CURRENT, "format": {**FORMAT, "x": 1}}}},
     "structured_outputs.structural_tag.format.x", "unknown key 'x'"),
    # empty structures; a trigger that starts no begin; both forms at once
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": TRIGGERS}},
     "response_format.structures", "non-empty list"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES,
                          "triggers": ["<tool="]}},
     "response_format.structures[0].begin", "starts with no trigger"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES,
                          "triggers": [*TRIGGERS, "<tool="]}},
     "response_format.triggers[1]", "is not a prefix of any tag's begin"),
    ({"response_format": {**CURRENT, "structures": STRUCTURES}}, "response_format.format",
     "not both"),
    # a schema the engine never serves (a remote $ref), checked before the engine
    ({"response_format": {"type": "structural_tag", "triggers": TRIGGERS,
                          "structures": [{**STRUCTURES[0], "schema": {"$ref": "http://x"}}]}},
     "response_format.structures[0].schema", "not a local reference"),
    # the engine's strict check (the fake runs the real one)
    ({"response_format": {"type": "structural_tag", "strict": True, "triggers": TRIGGERS,
                          "structures": [{**STRUCTURES[0], "schema": DATED}]}},
     "response_format.structures[0].schema",
     "structures[0].schema/properties/x: 'format': 'date'"),
    ({"structured_outputs": {"structural_tag": {"format": {
        "type": "json_schema", "json_schema": {"not": {}}}}}},
     "structured_outputs.structural_tag.format.json_schema", "accepts no finite JSON value"),
    # two grammars
    ({"response_format": CURRENT, "regex": "a"}, "regex", "only one"),
    ({"structured_outputs": {"structural_tag": CURRENT, "regex": "a"}}, "structured_outputs",
     "structural_tag"),
])
def test_bad_input_is_a_400_naming_the_field(client: TestClient, body: dict[str, Any],
                                             param: str, fragment: str) -> None:
    r = post(client, CHAT, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


@pytest.mark.parametrize("param, grammar_param, expected", [
    ("structural_tag", "response_format", "response_format"),
    ("structural_tag.structures[0].schema", "response_format",
     "response_format.structures[0].schema"),
    ("structural_tag.format.tags[1].begin", "structured_outputs.structural_tag",
     "structured_outputs.structural_tag.format.tags[1].begin"),
    ("structural_tagging", "response_format", "structural_tagging"),
    ("regex", "response_format.regex", "response_format.regex"),
    ("max_tokens", "response_format", "max_tokens"),
])
def test_engine_params_name_the_request_field(param: str, grammar_param: str,
                                              expected: str) -> None:
    assert request_param(param, grammar_param) == expected
