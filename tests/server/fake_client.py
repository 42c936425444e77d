"""A TestClient over the fake engine, and the one request helper the server field tests share
(no model, no engine process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fastapi.testclient import TestClient

from structspec.server.app import create_app
from structspec.server.log_config import ServerLogConfig
from structspec.server.metrics import ServerMetrics
from structspec.server.serving import ServerState
from tests.server.server_fakes import FakeCodec, FakeEngine

MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@contextlib.contextmanager
def fake_client(engine: FakeEngine, log_config: ServerLogConfig | None = None,
                tool_call_parser: str | None = None) -> Iterator[TestClient]:
    """The app over ``engine`` (fake codec, fresh metrics, model name ``fake``; the server's
    log lines as ``log_config`` says, by default the ``serve`` defaults; ``tool_call_parser``
    as ``--tool-call-parser``)."""
    state = ServerState(engine=engine, codec=FakeCodec(), metrics=ServerMetrics(),
                        model_name="fake", log_config=log_config or ServerLogConfig(),
                        tool_call_parser=tool_call_parser)
    with TestClient(create_app(state)) as c:
        yield c


def post(client: TestClient, path: str, **body: Any) -> Any:
    """POST a minimal valid request to ``path`` (chat or completions), ``body`` merged in."""
    base: dict[str, Any] = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    return client.post(path, json={**base, "max_tokens": 2, **body})

