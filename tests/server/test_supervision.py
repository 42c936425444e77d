"""Engine supervision: a killed engine process fails its in-flight requests with 503, is
restarted while ``/health`` answers 503, and the server serves again; when the restarts run
out the server exits with status 1.

The fast test runs the real front end (``launch.run_http``: uvicorn, the app, the
supervisor, ``EngineClient`` and its threads) and real engine processes (``engine_main``'s
loop and pipes) around a scripted engine (tests/server/scripted_engine.py), so an engine
process starts in about a second. The slow test does the same with the real model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from structspec.cli import build_parser, main
from structspec.server.engine_client import EngineClient
from structspec.server.launch import bind_socket, run_http
from structspec.server.supervisor import EngineSupervisor, RestartPolicy, policy_from_args
from tests.polling import wait_for
from tests.server.scripted_engine import ScriptedConfig, ScriptedEngine, failing_engine
from tests.server.server_fakes import FakeCodec
from tests.server.server_proc import running_server

CHAT = [{"role": "user", "content": "Tell a long story."}]


def health(url: str) -> tuple[int, dict[str, Any]]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, r.json()


async def _stream(c: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, list[str]]:
    events: list[str] = []
    body = {"prompt": "once upon a time", "max_tokens": 400, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
        return r.status_code, events


async def _plain(c: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 400})
    return r.status_code, r.json()


async def _load_then_kill(url: str, pid: int, streams: int,
                          plain: int) -> list[tuple[int, Any]]:
    """Start ``streams`` streamed and ``plain`` non-streamed long requests, SIGKILL the
    engine process once all of them run and every stream has sent output, and return every
    answer (bounded)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        started = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.ensure_future(_stream(c, e)) for e in started]
        tasks += [asyncio.ensure_future(_plain(c)) for _ in range(plain)]
        deadline = time.monotonic() + 120
        while ((await c.get("/health")).json()["num_inflight"] < streams + plain
               or not all(e.is_set() for e in started)):
            assert time.monotonic() < deadline, "the requests never all ran"
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))


def check_in_flight_failed_cleanly(answers: list[tuple[int, Any]], streams: int) -> None:
    """Every in-flight request was answered: streams with an error event before [DONE],
    the others with a 503 ``engine_unavailable``."""
    for status, events in answers[:streams]:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert "engine process exited (code -9)" in err["message"], err
        assert err["code"] == "engine_unavailable"
    for status, body in answers[streams:]:
        assert status == 503, body
        assert body["error"]["code"] == "engine_unavailable", body
        assert "engine process exited (code -9)" in body["error"]["message"], body


def test_killed_engine_is_restarted_and_the_server_exits_when_restarts_run_out(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="structspec.server")
    args = build_parser().parse_args([
        "serve", "--host", "127.0.0.1", "--port", "0", "--served-model-name", "fake",
        "--engine-restarts", "1", "--engine-restart-backoff", "1.0"])
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    config = ScriptedConfig(tick_s=0.02)

    def make_client() -> EngineClient:
        return EngineClient(config, engine_factory=ScriptedEngine)  # type: ignore[arg-type]

    client = make_client()
    client.start(timeout=60)
    supervisor = EngineSupervisor(client, make_client, policy_from_args(args))
    result: dict[str, int] = {}
    thread = threading.Thread(
        target=lambda: result.update(code=run_http(args, sock, supervisor, FakeCodec())),
        daemon=True)
    thread.start()
    try:
        wait_for("the first /health 200", lambda: _status(url) == 200, 30)
        # --port 0: the log names the port actually bound (it used to say 0)
        assert f"on http://127.0.0.1:{port} (engine pid {client.process.pid}" in caplog.text

        # 1. kill the engine under load: every in-flight request is answered with a 503
        answers = asyncio.run(_load_then_kill(url, client.process.pid, streams=3, plain=3))
        check_in_flight_failed_cleanly(answers, streams=3)

        # 2. /health is 503 while the engine restarts; requests get a 503 with Retry-After
        wait_for("/health 503 (restarting)", lambda: _restarting(url), 10)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=10)
        if r.status_code == 503:  # the restart may already be done: then it is served
            assert r.json()["error"]["code"] == "engine_unavailable"
            assert r.headers["retry-after"] == "5"

        # 3. then 200 again, with a new engine process, and requests succeed
        wait_for("/health 200 after the restart", lambda: _status(url) == 200, 30)
        status, body = health(url)
        assert body["engine_restarts"] == 1 and body["restarting"] is False
        assert supervisor.client is not client and supervisor.client.process.pid != \
            client.process.pid
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "xxx"

        # 4. a second death within reset_after_s: no restart left -> the server exits 1
        os.kill(supervisor.client.process.pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the server did not exit after its restarts ran out"
        assert result["code"] == 1
        assert "no restart left (--engine-restarts 1)" in caplog.text
    finally:
        if thread.is_alive() and supervisor.on_exhausted is not None:
            supervisor.on_exhausted("test cleanup")  # uvicorn's should_exit
            thread.join(15)
        supervisor.shutdown(5)
        sock.close()


def _restarting(url: str) -> bool:
    status, body = health(url)
    return status == 503 and body["restarting"] is True


def _status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_restarts_that_fail_to_load_count_and_the_supervisor_gives_up() -> None:
    config = ScriptedConfig()
    first = EngineClient(config, engine_factory=ScriptedEngine)  # type: ignore[arg-type]
    first.start(timeout=60)
    made: list[EngineClient] = []

    def make_client() -> EngineClient:
        made.append(EngineClient(config, engine_factory=failing_engine))  # type: ignore[arg-type]
        return made[-1]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gave_up: asyncio.Future[str] = loop.create_future()
        supervisor = EngineSupervisor(first, make_client,
                                      RestartPolicy(max_restarts=2, backoff_s=0.05),
                                      on_exhausted=gave_up.set_result)
        supervisor.attach(loop)
        try:
            assert supervisor.ready
            os.kill(first.process.pid, signal.SIGKILL)
            reason = await asyncio.wait_for(gave_up, 60)
            assert reason.startswith("restart failed: RuntimeError: no model here"), reason
            assert len(made) == 2 and supervisor.restarts == 0
            assert not supervisor.ready and not supervisor.restarting
            assert all(c.process.exitcode is not None for c in made)  # none left running
        finally:
            await supervisor.aclose(5)

    asyncio.run(scenario())


def test_restart_policy_backoff_and_flags() -> None:
    p = RestartPolicy(max_restarts=4, backoff_s=0.5, max_backoff_s=3.0)
    assert [p.backoff(k) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    args = build_parser().parse_args(["serve"])
    assert policy_from_args(args) == RestartPolicy()
    for flags, words in ((["--engine-restarts", "-1"], "--engine-restarts: expected"),
                         (["--engine-restart-backoff", "-2"], "--engine-restart-backoff: "),
                         (["--engine-restart-backoff", "inf"], "--engine-restart-backoff: ")):
        with pytest.raises(ValueError, match=re.escape(words)):
            policy_from_args(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize("flags,words", [
    (["--engine-restarts", "-1"], "--engine-restarts: expected an integer >= 0"),
    (["--max-queued-requests", "10", "--max-choices-per-request", "20"],
     "--max-queued-requests: max_queued_requests=10 is below max_choices_per_request=20"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars: max_prompt_chars=0: expected"),
])
def test_bad_server_options_exit_2_before_the_engine_starts(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err, err


@pytest.mark.slow
def test_real_engine_killed_under_load_restarts() -> None:
    """The same with the real model (a restart reloads it: tens of seconds on 2 cores)."""
    with running_server("--max-model-len", "512", "--max-batch-size", "4",
                        "--engine-restarts", "2", "--engine-restart-backoff", "0.5") as s:
        m = re.search(r"engine pid (\d+)", s.log_path.read_text())
        assert m, s.log_tail()
        answers = asyncio.run(_load_then_kill(s.url, int(m.group(1)), streams=2, plain=2))
        check_in_flight_failed_cleanly(answers, streams=2)
        wait_for("/health 503", lambda: _status(s.url) == 503, 30)
        wait_for("/health 200 after the restart", lambda: _status(s.url) == 200, 300, 0.5)
        assert health(s.url)[1]["engine_restarts"] == 1
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"messages": CHAT, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert s.proc.poll() is None
