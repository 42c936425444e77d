"""Issue 17's runaway-compile repro at the engine level (the server's engine process runs this
same loop): four 10,000-property schemas at once under a short compile limit fail at their
limit with ``grammar_too_complex``, a cheap ``choice`` request sent meanwhile finishes in
under 2 s, and within 5 s the engine and its compile processes are back to idle CPU with
their summed RSS within 10% of before."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from structspec.constraints import ChoiceConstraint, JsonSchemaConstraint
from structspec.core import SamplingParams
from structspec.grammar.compile_pool import GENERAL

LIMIT_S = 3.0
NUM_RUNAWAY = 4


def _proc(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of ``pid`` from /proc (0, 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


def _usage(pids: list[int], window_s: float = 0.5) -> tuple[float, int]:
    """(cores busy over ``window_s``, summed RSS bytes at its end) of ``pids``."""
    start = sum(_proc(p)[0] for p in pids)
    time.sleep(window_s)
    now = [_proc(p) for p in pids]
    return (sum(c for c, _ in now) - start) / window_s, sum(r for _, r in now)


@pytest.mark.slow
def test_runaway_compiles_are_contained(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    backend = engine.grammar
    backend.compile(ChoiceConstraint(("warm",)), timeout=120)  # compile processes are up
    saved = backend.config
    # a short limit, and the property limit lifted so that the repro reaches the compiler
    backend.config = dataclasses.replace(saved, compile_timeout_s=LIMIT_S,
                                         max_schema_properties=20_000)
    try:
        pids = [os.getpid(), *backend.worker_pids()]
        busy_before, rss_before = _usage(pids)
        t0 = time.perf_counter()
        for i in range(NUM_RUNAWAY):
            schema = {"type": "object", "properties": {
                f"r{i}_{j}": {"type": "integer"} for j in range(10_000)}}
            engine.add_request("Fill the form.", SamplingParams(
                max_tokens=8, grammar=JsonSchemaConstraint(schema, strict=False)),
                request_id=f"runaway-{i}")
        finished: dict[str, tuple[float, Any]] = {}
        cheap_sent: float | None = None
        general = backend.pool.status()[GENERAL].size

        def runaways_running() -> bool:
            """Every general compile worker runs a runaway (the state the cheap request must
            not wait behind; a fixed delay guessed it)."""
            return backend.pool.status()[GENERAL].busy == min(general, NUM_RUNAWAY)

        while len(finished) < NUM_RUNAWAY + 1:
            now = time.perf_counter()
            assert now - t0 < 60, finished.keys()
            if cheap_sent is None and runaways_running():  # while the four are compiling
                engine.add_request("Yes or no?", SamplingParams(
                    max_tokens=4, grammar=ChoiceConstraint(("yes", "no"))),
                    request_id="cheap")
                cheap_sent = time.perf_counter()
            for out in engine.step() if engine.has_unfinished_requests() else []:
                if out.finished:
                    finished[out.request_id] = (time.perf_counter(), out)
            time.sleep(0.002)
        assert cheap_sent is not None
        cheap_at, cheap = finished["cheap"]
        cheap_s = cheap_at - cheap_sent
        assert cheap.error is None and cheap.text in ("yes", "no"), cheap
        assert cheap_s < 2.0, cheap_s
        last_fail = 0.0
        for i in range(NUM_RUNAWAY):
            at, out = finished[f"runaway-{i}"]
            assert out.error_code == "grammar_too_complex", out.error
            assert out.error_param == "json_schema"
            assert f"within the {LIMIT_S:g} s limit" in (out.error or "")
            last_fail = max(last_fail, at - t0)
        assert last_fail < LIMIT_S + 1.0, last_fail
        # back to idle within 5 s: the killed workers are replaced by fresh forks
        settle_start = time.perf_counter()
        while True:
            pids_after = [os.getpid(), *backend.worker_pids()]
            busy, rss = _usage(pids_after)
            settled_s = time.perf_counter() - settle_start
            if busy < max(0.2, 2 * busy_before) and abs(rss - rss_before) <= 0.1 * rss_before:
                break
            assert settled_s < 5.0, (busy, rss / 2**20, rss_before / 2**20)
        print(f"\ncheap choice: {cheap_s:.2f} s; runaways failed by {last_fail:.2f} s "
              f"(limit {LIMIT_S:g} s); idle after {settled_s:.1f} s: {busy:.2f} cores, RSS "
              f"{rss / 2**20:.0f} MiB vs {rss_before / 2**20:.0f} MiB before "
              f"({len(pids_after)} processes)")
    finally:
        backend.config = saved
