"""End-to-end with n-gram speculation on (``--speculative-algorithm ngram``): structured
outputs stay valid, streaming agrees with non-streaming, and ``usage.speculative`` /
``/metrics`` report the drafts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.server_proc import ServerHandle, running_server

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string",
                                                         "enum": ["apple", "pear", "plum"]},
                             "maxItems": 2}},
    "required": ["items"],
    "additionalProperties": False,
}
REPEAT = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta alpha beta "
                                      "gamma delta alpha beta gamma delta"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with running_server("--speculative-algorithm", "ngram", "--num-draft-tokens", "6",
                        "--served-model-name", "x",  # requests name model "x"; others are 404
                        "--max-model-len", "1024", "--max-batch-size", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120,
                         max_retries=0)


def test_speculation_drafts_and_stream_matches(client: openai.OpenAI) -> None:
    kw = dict(model="x", messages=REPEAT, max_tokens=16, temperature=0)
    out = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    spec = out.usage.model_extra["speculative"]  # type: ignore[union-attr,index]
    assert spec["draft_tokens_proposed"] > 0, spec
    assert spec["accept_length"] >= 1.0
    chunks = list(client.chat.completions.create(**kw, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        out.choices[0].message.content


def test_json_schema_and_regex_under_speculation(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "List some fruit as JSON."}],
        max_tokens=30, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "fruit", "schema": SCHEMA, "strict": True}})
    c = out.choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
    comp = client.completions.create(model="x", prompt="alpha beta alpha beta alpha",
                                     max_tokens=12, temperature=0,
                                     extra_body={"regex": r"( (alpha|beta)){1,6}"})
    assert re.fullmatch(r"( (alpha|beta)){1,6}", comp.choices[0].text)


class Pick(BaseModel):
    fruit: Literal["apple", "pear"]
    ripe: bool


def test_parse_under_speculation(client: openai.OpenAI, server: ServerHandle) -> None:
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions.parse
    out = parse(model="x", response_format=Pick, max_tokens=30, temperature=0,
                messages=[{"role": "user", "content": "Pick a ripe fruit, as JSON."}])
    assert isinstance(out.choices[0].message.parsed, Pick)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(r"^structspec_spec_draft_tokens_total ([0-9.e+]+)$", text, re.M)
    assert m and float(m.group(1)) > 0
    assert re.search(r"^structspec_spec_accept_length [0-9.]+$", text, re.M)


def test_batched_json_under_speculation(server: ServerHandle) -> None:
    """Several grammar requests verified together (parallel tree mask builds)."""

    async def go() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                     timeout=120, max_retries=0)
        outs = await asyncio.gather(*(aclient.chat.completions.create(
            model="x", max_tokens=30, temperature=0,
            messages=[{"role": "user", "content": f"List fruit #{i} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "fruit", "schema": SCHEMA, "strict": True}}) for i in range(3)))
        await aclient.close()
        return list(outs)

    for out in asyncio.run(go()):
        c = out.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)


def test_sigterm_aborts_in_flight_and_joins_engine(server: ServerHandle) -> None:
    """Last test of the module: SIGTERM mid-stream ends the stream with an error event,
    the server exits 0 and its engine process is gone."""
    if server.proc.poll() is not None:
        pytest.skip(f"the server already exited ({server.proc.returncode}): see earlier failures")
    m = re.search(r"engine pid (\d+)", server.log_path.read_text())
    assert m, server.log_tail()
    engine_pid = int(m.group(1))
    body = {"model": "x", "messages": REPEAT, "max_tokens": 500, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:  # role chunk + first token
                    server.proc.send_signal(signal.SIGTERM)
            if len(events) > 600:
                break
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "engine process still alive"
        time.sleep(0.2)
