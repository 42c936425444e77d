"""EngineClient pickles a request on the caller's side: one that cannot be pickled fails
alone (it used to kill the sender thread, and every later request then waited forever)."""

from __future__ import annotations

from typing import Any

import pytest

from structspec.config import EngineConfig
from structspec.constraints import JsonSchemaConstraint
from structspec.core import SamplingParams
from structspec.server.engine_client import EngineClient
from structspec.server.ipc import AddRequest


def test_unpicklable_request_fails_alone_and_the_next_one_is_sent() -> None:
    client = EngineClient(EngineConfig(device="cpu"))  # not spawned: no engine process
    client.info = object()  # type: ignore[assignment]  # "ready"
    try:
        deep: dict[str, Any] = {}
        cur = deep
        for _ in range(5000):  # past the recursion limit of pickle
            cur["a"] = {}
            cur = cur["a"]
        bad = SamplingParams(max_tokens=4, grammar=JsonSchemaConstraint(deep, strict=False))
        with pytest.raises(RecursionError):
            client.add_request("bad", [1, 2], bad, sink=lambda delta: None)  # type: ignore[arg-type]
        assert client.num_inflight == 0  # nothing registered, nothing queued
        client.add_request("good", [1, 2], SamplingParams(max_tokens=4),
                           sink=lambda delta: None)  # type: ignore[arg-type]
        client._flush_outbox()  # noqa: SLF001 - what the sender thread does
        msg = client._to_engine_r.recv()  # noqa: SLF001 - the engine process's end
        assert isinstance(msg, AddRequest) and msg.request_id == "good"
        assert msg.prompt_token_ids == [1, 2] and msg.params.max_tokens == 4
    finally:
        for conn in (client._to_engine_r, client._to_engine_w,  # noqa: SLF001
                     client._from_engine_r, client._from_engine_w):  # noqa: SLF001
            conn.close()
