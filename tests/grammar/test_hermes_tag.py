"""The auto tool-call tag of ``--tool-call-parser hermes`` (server/hermes_tools.py) on the
xgrammar backend: free text and Hermes calls of the tools with valid arguments are accepted,
arguments outside a tool's schema, an unknown tool and a call that never ends are not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from structspec.grammar import GrammarBackend
from structspec.server.hermes_tools import hermes_tag

from .conftest import STOP_ID

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER, "strict": True},
             {"name": "get_time", "strict": True}]


def _call(name: str, args: Any) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


@pytest.mark.parametrize(("text", "ok"), [
    ("Just text.", True),
    ("Let me check. " + _call("get_weather", {"city": "Oslo", "days": 2}), True),
    (_call("get_weather", {"city": "Oslo"}) + "\n" + _call("get_time", {}), True),
    (_call("get_weather", {"city": 3}), False),
    (_call("get_weather", {"days": 2}), False),
    (_call("get_weather", {"city": "Oslo", "extra": 1}), False),
    (_call("get_news", {}), False),
    (_call("get_weather", {"city": "Oslo"})[:-len("</tool_call>")], False),
])
def test_the_tag_accepts_exactly_hermes_calls_of_the_tools(backend: GrammarBackend,
                                                           hf_tokenizer: Any, text: str,
                                                           ok: bool) -> None:
    compiled = backend.compile(hermes_tag(FUNCTIONS), timeout=60)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    m = backend.create_matcher(compiled)
    assert (m.accept_run([*ids, STOP_ID]) == len(ids) + 1) == ok
