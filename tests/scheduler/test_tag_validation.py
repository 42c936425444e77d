"""``schema_valid`` of structural-tag outputs (``check_tag_output``): each tagged section's
JSON body checked with ``jsonschema`` against its tag's schema, in both forms of the tag and
for the Hermes auto tool-call tags; other tag shapes get no verdict."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from structspec.constraints import StructuralTagConstraint
from structspec.scheduler.validate import check_schema_output, check_tag_output
from structspec.server.hermes_tools import call_begin, hermes_tag

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}
LEGACY = {"structures": [{"begin": "<f=weather>", "schema": WEATHER, "end": "</f>"},
                         {"begin": "<f=time>", "schema": TIME, "end": "</f>"}],
          "triggers": ["<f="]}
CURRENT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="], "stop_after_first": False,
    "tags": [{"type": "tag", "begin": s["begin"],
              "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
             for s in LEGACY["structures"]]}}
BODIES = [("weather", {"city": "Rome", "days": 2}), ("weather", {"city": "Rome", "days": 0}),
          ("weather", {"city": "Rome"}), ("time", {"zone": "UTC"}), ("time", {"zone": "PST"}),
          ("weather", {"city": "a </f> b", "days": 3})]


def _expected(name: str, body: dict[str, Any]) -> bool:
    schema = WEATHER if name == "weather" else TIME
    return jsonschema.Draft202012Validator(schema).is_valid(body)


@pytest.mark.parametrize("tag", [LEGACY, CURRENT, json.dumps(LEGACY)])
def test_each_section_is_checked_against_its_schema(tag: Any) -> None:
    spec = StructuralTagConstraint(tag)
    for name, body in BODIES:
        text = f"Sure. <f={name}>{json.dumps(body)}</f> and done."
        assert check_tag_output(spec, text) is _expected(name, body), text
        assert check_schema_output(spec, text) is _expected(name, body)
    # two sections: valid only when both are; whitespace around the body is allowed
    good = '<f=weather> {"city": "Oslo", "days": 1} </f><f=time>{"zone": "CET"}</f>'
    assert check_tag_output(spec, good) is True
    assert check_tag_output(spec, good.replace("CET", "PST")) is False
    assert check_tag_output(spec, "No section at all.") is True


def test_cut_or_unclosed_sections_are_not_valid() -> None:
    spec = StructuralTagConstraint(LEGACY)
    assert check_tag_output(spec, '<f=time>{"zone": "UT') is False  # cut by max_tokens
    assert check_tag_output(spec, '<f=time>{"zone": "UTC"}') is False  # no end string
    assert check_tag_output(spec, '<f=time>{"zone": "UTC"}</g>') is False


def test_hermes_tool_call_tags() -> None:
    """The auto tool-call tags (both ``parallel_tool_calls`` values): a call's arguments are
    the body between the begin (which holds the name) and the ``}\\n</tool_call>`` end."""
    tools = [{"name": "get_weather", "parameters": WEATHER},
             {"name": "get_time", "parameters": TIME}]
    for spec in (hermes_tag(tools), hermes_tag(tools, parallel=False)):
        for name, body in BODIES:
            fn = "get_" + name
            text = f"Let me see.\n{call_begin(fn)}{json.dumps(body)}}}\n</tool_call>"
            assert check_tag_output(spec, text) is _expected(name, body), text


@pytest.mark.parametrize("tag", [
    {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": TIME}},
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="],
     "tags": [{"type": "tag", "begin": "<f=x>", "end": "</f>",
               "content": {"type": "json_schema", "json_schema": TIME,
                           "style": "qwen_xml"}}]}},
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="],
     "tags": [{"type": "tag", "begin": "<f=x>", "end": "</f>",
               "content": {"type": "regex", "pattern": "a+"}}]}},
])
def test_other_tag_shapes_get_no_verdict(tag: dict[str, Any]) -> None:
    assert check_tag_output(StructuralTagConstraint(tag), '<f=x>{"zone": "UTC"}</f>') is None
