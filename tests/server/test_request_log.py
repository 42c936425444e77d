"""The server's log lines (issue 23): one line per chat / completions request, whatever
ended it, and the periodic engine-stats line; both switchable off (fake engine, no model)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from structspec.cli import build_parser, main
from structspec.server.app import create_app
from structspec.server.ipc import EngineStats
from structspec.server.log_config import ServerLogConfig, log_config_from_args
from structspec.server.metrics import ServerMetrics
from structspec.server.request_log import log_record_fields
from structspec.server.serving import ServerState
from structspec.server.stats_log import StatsLogger
from tests.server.fake_client import CHAT, COMPLETIONS, MSGS, SCHEMA, fake_client, post
from tests.server.server_fakes import FakeCodec, FakeEngine

LOGGER = "structspec.server"


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The fields of every request line logged so far."""
    return [log_record_fields(r.getMessage()) for r in caplog.records
            if r.name == LOGGER and r.getMessage().startswith("request ")]


def stats_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.getMessage().startswith("stats ")]


def only_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    lines = request_lines(caplog)
    assert len(lines) == 1, lines
    assert all(r.levelno == logging.INFO for r in caplog.records
               if r.getMessage().startswith("request "))
    return lines[0]


@pytest.fixture(autouse=True)
def _info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)


def test_normal_request_one_line_with_its_usage(client: TestClient,
                                                caplog: pytest.LogCaptureFixture) -> None:
    r = post(client, CHAT, max_tokens=50, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    body = r.json()
    f = only_line(caplog)
    usage = body["usage"]
    assert f["id"] == body["id"] and f["endpoint"] == "chat"
    assert (f["status"], f["outcome"], f["stream"], f["choices"]) == ("200", "stop", "false", "1")
    assert int(f["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(f["completion_tokens"]) == usage["completion_tokens"] > 0
    assert f["grammar"] == "json_schema"
    assert f["accept_len"] == f"{usage['speculative']['accept_length']:.2f}"
    assert 0 < float(f["ttft_ms"]) <= float(f["latency_ms"])
    assert "error" not in f and "param" not in f


@pytest.mark.parametrize("body,status,error,param,grammar", [
    ({"n": 0}, 400, "invalid_request_parameter", "n", "-"),  # refused before the grammar
    ({"max_tokens": 10**6}, 400, "context_length_exceeded", "max_tokens", "none"),
    ({"regex": "BAD(", "max_tokens": 5}, 400, "invalid_request_parameter", "regex", "regex"),
    ({"model": "other"}, 404, "404", "model", "-"),
])
def test_refused_request_one_line_naming_the_error(
        client: TestClient, caplog: pytest.LogCaptureFixture, body: dict[str, Any],
        status: int, error: str, param: str, grammar: str) -> None:
    r = post(client, CHAT, **body)
    assert r.status_code == status, r.text
    f = only_line(caplog)
    assert (f["status"], f["outcome"], f["error"], f["param"]) == (str(status), "error", error,
                                                                   param)
    assert f["grammar"] == grammar and f["completion_tokens"] == "0"
    assert f["ttft_ms"] == "-" and f["accept_len"] == "-"
    assert f["id"].startswith("chatcmpl-")


def test_bad_json_line_and_completions_id(client: TestClient,
                                          caplog: pytest.LogCaptureFixture) -> None:
    r = client.post(COMPLETIONS, content=b"{not json", headers={"content-type":
                                                                 "application/json"})
    assert r.status_code == 400
    f = only_line(caplog)
    assert f["endpoint"] == "completions" and f["id"].startswith("cmpl-")
    assert (f["status"], f["outcome"], f["stream"], f["grammar"]) == ("400", "error", "-", "-")


def test_stream_with_n_choices_one_line(client: TestClient,
                                        caplog: pytest.LogCaptureFixture) -> None:
    r = post(client, COMPLETIONS, prompt=["ab", "cde"], n=2, max_tokens=6, stream=True,
             stream_options={"include_usage": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    usage = events[-1]["usage"]
    f = only_line(caplog)
    assert (f["status"], f["outcome"], f["stream"], f["choices"]) == ("200", "length", "true",
                                                                      "4")
    assert int(f["prompt_tokens"]) == usage["prompt_tokens"] == 5
    assert int(f["completion_tokens"]) == usage["completion_tokens"] == 24
    assert f["grammar"] == "none" and f["id"] == events[0]["id"]


def test_stream_failing_after_its_headers_is_an_error_line(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    """One choice of two fails to compile while the other streams: the 200 stream carries an
    error event, and the line says so (the status sent, outcome error)."""
    engine: FakeEngine = client.app.state.server.engine  # type: ignore[attr-defined]
    real_run = engine._run

    first_output = asyncio.Event()

    class Tap:
        """Choice 0's sink: tells choice 1 that an output has gone out (the stream is open)."""

        def __init__(self, queue: Any) -> None:
            self.queue = queue

        def put_nowait(self, delta: Any) -> None:
            self.queue.put_nowait(delta)
            first_output.set()

    async def one_bad(rid: str, prompt: list[int], params: Any, sink: Any) -> None:
        if rid.endswith("-0"):
            sink = Tap(sink)
        else:
            await first_output.wait()  # fail only once choice 0's output opened the stream
            from dataclasses import replace

            from structspec.constraints import RegexConstraint
            params = replace(params, grammar=RegexConstraint("BAD("))
        await real_run(rid, prompt, params, sink)

    engine._run = one_bad  # type: ignore[method-assign]
    r = post(client, CHAT, n=2, max_tokens=200, stream=True)
    assert r.status_code == 200 and '"error"' in r.text
    f = only_line(caplog)
    assert (f["status"], f["outcome"], f["error"], f["param"]) == (
        "200", "error", "invalid_request_parameter", "regex")


async def _drive(app: Any, body: dict[str, Any], leave_after_s: float) -> list[dict[str, Any]]:
    """Send ``body`` to the chat endpoint through ASGI; the client hangs up after
    ``leave_after_s`` (a non-stream) or after the stream's first body part."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    first_part = asyncio.Event()
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        if body.get("stream"):
            await first_part.wait()
        else:
            await asyncio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_part.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    # the server aborts the engine requests as the handler unwinds: wait for all of them
    engine = app.state.server.engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while len(engine.aborted) < len(engine.added) and loop.time() < deadline:
        await asyncio.sleep(0.001)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_one_line(caplog: pytest.LogCaptureFixture, stream: bool) -> None:
    engine = FakeEngine(tick_s=0.005)
    state = ServerState(engine=engine, codec=FakeCodec(), metrics=ServerMetrics(),
                        model_name="fake")
    app = create_app(state)
    body = {"messages": MSGS, "max_tokens": 400, "stream": stream, "n": 2}
    sent = asyncio.run(_drive(app, body, leave_after_s=0.05))
    assert sorted(engine.aborted) == sorted(rid for rid, _, _ in engine.added)
    f = only_line(caplog)
    assert f["outcome"] == "disconnected" and f["choices"] == "2"
    assert f["status"] == ("200" if stream else "499") == str(sent[0]["status"])
    assert 0 < int(f["completion_tokens"]) < 800


def test_unexpected_exception_one_line(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenCodec(FakeCodec):
        def encode_chat(self, *args: Any, **kwargs: Any) -> list[int]:
            raise RuntimeError("tokenizer bug")

    state = ServerState(engine=FakeEngine(), codec=BrokenCodec(), metrics=ServerMetrics(),
                        model_name="fake")
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        assert post(c, CHAT).status_code == 500
    f = only_line(caplog)
    assert (f["status"], f["outcome"], f["error"]) == ("500", "error", "RuntimeError")


def test_disable_log_requests(caplog: pytest.LogCaptureFixture) -> None:
    with fake_client(FakeEngine(), ServerLogConfig(log_requests=False)) as c:
        r = post(c, CHAT)
        assert r.status_code == 200 and r.json()["id"].startswith("chatcmpl-")
        assert post(c, CHAT, n=0).status_code == 400
    assert request_lines(caplog) == []


class QueuedEngine(FakeEngine):
    """A fake engine whose stats show a busy queue."""

    @property
    def stats(self) -> EngineStats:
        return EngineStats(num_running=3, num_waiting=2, num_waiting_grammar=1,
                           kv_free_pages=30, kv_total_pages=40)


def test_stats_line_from_the_engine_stats(caplog: pytest.LogCaptureFixture) -> None:
    with fake_client(QueuedEngine(), ServerLogConfig(stats_interval_s=0.05)):
        deadline = time.monotonic() + 5
        while not stats_lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = stats_lines(caplog)
    assert lines, "no stats line"
    f = log_record_fields(lines[0])
    assert (f["running"], f["waiting"], f["waiting_grammar"], f["kv_cache_usage"]) == (
        "3", "2", "1", "25.0%")
    assert set(f) == {"interval_s", "prompt_tokens_per_s", "generation_tokens_per_s",
                      "finished", "running", "waiting", "waiting_grammar", "kv_cache_usage",
                      "prefix_cache_hit_rate", "preemptions"}
    assert f["prefix_cache_hit_rate"] == "-"  # the fake engine reports no prefix-cache query
    assert f["preemptions"] == "0"


def test_disable_log_stats(caplog: pytest.LogCaptureFixture) -> None:
    with fake_client(QueuedEngine(), ServerLogConfig(log_stats=False, stats_interval_s=0.02)):
        time.sleep(0.2)
    assert stats_lines(caplog) == []


def test_stats_throughput_from_the_counters_and_idle_skipped(client: TestClient) -> None:
    state: ServerState = client.app.state.server  # type: ignore[attr-defined]
    stats = EngineStats()
    logger = StatsLogger(state.metrics, lambda: stats, 10.0)
    t0 = time.monotonic()
    assert logger.tick(t0) is None  # idle: nothing logged
    r = post(client, COMPLETIONS, prompt="abcd", max_tokens=5)
    assert r.status_code == 200
    line = logger.tick(t0 + 2.0)
    assert line is not None
    f = log_record_fields(line)
    assert (f["interval_s"], f["prompt_tokens_per_s"], f["generation_tokens_per_s"],
            f["finished"], f["running"], f["kv_cache_usage"]) == ("2.00", "2.0", "2.5", "1",
                                                                  "0", "-")
    assert logger.tick(t0 + 4.0) is None  # nothing happened since


def test_log_flags() -> None:
    assert log_config_from_args(build_parser().parse_args(["serve"])) == ServerLogConfig()
    args = build_parser().parse_args(["serve", "--disable-log-requests", "--disable-log-stats",
                                      "--log-stats-interval", "2.5"])
    assert log_config_from_args(args) == ServerLogConfig(False, False, 2.5)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_bad_log_stats_interval_exits_2_naming_the_flag(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", "--log-stats-interval", value]) == 2
    err = capsys.readouterr().err
    assert "--log-stats-interval: stats_interval_s=" in err and "seconds > 0" in err, err
    assert "starting the engine" not in err


def test_non_number_log_stats_interval_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--log-stats-interval", "soon"])
    assert e.value.code == 2
    assert "--log-stats-interval" in capsys.readouterr().err
    assert math.isfinite(ServerLogConfig().stats_interval_s)
