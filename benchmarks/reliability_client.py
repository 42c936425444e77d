"""Send reliability requests, judge every answer, read the server's gauges and memory.

:func:`send` sends one :class:`~benchmarks.reliability_requests.PlannedRequest` (reading the
SSE stream, or closing it early for a mid-stream disconnect) and records an
:class:`Outcome`; :func:`problems` lists what is wrong with that answer (a 5xx, a stream
without exactly one ``[DONE]``, a choice finished twice or never, an invalid structured
output, a 4xx that does not name the field...). :func:`run_requests` drives a list of them
from a bounded number of concurrent clients, each request under a time limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.hostile_requests import names_field
from benchmarks.reliability_requests import PlannedRequest, output_problem

GAUGES = ("structspec_num_requests_running", "structspec_num_requests_waiting",
          "structspec_num_requests_waiting_grammar", "structspec_num_requests_inflight")
"""The queue gauges of ``/metrics`` that must be back to 0 once every request ended."""

KEEPALIVE_S = 2.0
"""Client keep-alive of idle connections, below the server's (5 s)."""

QUEUE_FULL = 429
"""An admission refusal (queue full): a fair answer to a good request under load."""


@dataclass
class Outcome:
    """What the client saw for one request.

    Args:
        status: HTTP status; None when no response arrived (transport error, timeout).
        transport_error: the exception, when no response arrived or the body broke off.
        error: the JSON error object of a non-200 answer, or of an SSE error event.
        texts: output text per choice index.
        finishes: finish reasons seen per choice index (a list: a choice finished twice is
            a problem).
        done_events: how many ``data: [DONE]`` events arrived.
        events_after_done: SSE events that arrived after ``[DONE]``.
        disconnected: the client closed the stream on purpose before its end.
        latency_s: send to the end of the answer (or to the disconnect).
        body_text: the start of a non-200 body (for reports).
    """

    request: PlannedRequest
    status: int | None = None
    transport_error: str | None = None
    error: dict[str, Any] | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    done_events: int = 0
    events_after_done: int = 0
    disconnected: bool = False
    latency_s: float = 0.0
    body_text: str = ""


async def send(client: httpx.AsyncClient, base_url: str, req: PlannedRequest,
               timeout_s: float) -> Outcome:
    """Send ``req`` and record the answer; never raises for HTTP or transport trouble."""
    out = Outcome(req)
    t0 = time.perf_counter()
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", base_url + req.path, content=req.raw,
                                     headers=headers) as r:
                out.status = r.status_code
                if r.status_code != 200 or not req.stream:
                    body = await r.aread()
                    _read_body(out, body)
                else:
                    await _read_stream(out, r, req.disconnect_after)
    except TimeoutError:
        out.transport_error = f"no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as e:
        out.transport_error = f"{type(e).__name__}: {e}"
    out.latency_s = time.perf_counter() - t0
    return out


def _read_body(out: Outcome, body: bytes) -> None:
    out.body_text = body[:300].decode("utf-8", "replace")
    try:
        doc = json.loads(body)
    except ValueError:
        return
    if not isinstance(doc, dict):
        return
    if out.status != 200:
        err = doc.get("error")
        out.error = err if isinstance(err, dict) else None
        return
    for c in doc.get("choices") or []:
        i = int(c.get("index", 0))
        msg = c.get("message")
        text = msg.get("content") if isinstance(msg, dict) else c.get("text")
        out.texts[i] = text or ""
        if c.get("finish_reason") is not None:
            out.finishes.setdefault(i, []).append(c["finish_reason"])


async def _read_stream(out: Outcome, r: httpx.Response, disconnect_after: int | None) -> None:
    events = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if out.done_events:
            out.events_after_done += 1
        if data == "[DONE]":
            out.done_events += 1
            continue
        events += 1
        event = json.loads(data)
        if "error" in event:
            out.error = event["error"]
        for c in event.get("choices") or []:
            i = int(c.get("index", 0))
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            out.texts[i] = out.texts.get(i, "") + (piece or "")
            if c.get("finish_reason") is not None:
                out.finishes.setdefault(i, []).append(c["finish_reason"])
        if disconnect_after is not None and events >= disconnect_after:
            out.disconnected = True
            return  # leaving the context closes the connection mid-stream


def problems(o: Outcome) -> list[str]:
    """What is wrong with one answer (empty when it is right)."""
    req = o.request
    where = f"#{req.index} {req.kind}" + (f" {req.hostile.case}" if req.hostile else "")
    if o.status is None:
        return [f"{where}: no answer ({o.transport_error})"]
    if o.status >= 500:
        return [f"{where}: HTTP {o.status} {o.body_text[:200]}"]
    if o.transport_error is not None and not o.disconnected:
        return [f"{where}: answer broke off ({o.transport_error})"]
    if o.status != 200:
        return _error_problems(o, where)
    if req.expect_error:
        return [f"{where}: HTTP 200, expected a 4xx naming "
                f"{req.hostile.fields if req.hostile else req.bad_field}"]
    if o.disconnected:
        return []
    out: list[str] = []
    if req.stream:
        if o.done_events != 1 or o.events_after_done:
            out.append(f"{where}: {o.done_events} [DONE] events, {o.events_after_done} after")
        if o.error is not None:
            out.append(f"{where}: error event in a 200 stream: {o.error}")
            return out
    want = set(range(req.n))
    if set(o.finishes) != want or any(len(f) != 1 for f in o.finishes.values()):
        out.append(f"{where}: finish reasons {o.finishes}, expected one per choice {want}")
    for i, reasons in o.finishes.items():
        if reasons and reasons[0] == "stop":
            bad = output_problem(req.kind, o.texts.get(i, ""))
            if bad is not None:
                out.append(f"{where} choice {i}: {bad}")
    return out


def _error_problems(o: Outcome, where: str) -> list[str]:
    req = o.request
    if o.error is None or not o.error.get("message"):
        return [f"{where}: HTTP {o.status} without a JSON error body: {o.body_text[:200]!r}"]
    if not req.expect_error:
        if o.status == QUEUE_FULL:
            return []
        return [f"{where}: HTTP {o.status} for a valid request: {o.error}"]
    fields = req.hostile.fields if req.hostile else (req.bad_field or "",)
    out = []
    if not names_field(o.error, fields):
        out.append(f"{where}: error does not name {fields}: {o.error}")
    code = req.hostile.expect_code if req.hostile else None
    if code is not None and o.error.get("code") != code:
        out.append(f"{where}: error code {o.error.get('code')!r}, expected {code!r}")
    return out


async def run_requests(base_url: str, requests: Sequence[PlannedRequest], *,
                       concurrency: int, timeout_s: float,
                       headers: dict[str, str] | None = None) -> list[Outcome]:
    """Send ``requests`` from ``concurrency`` clients (each its own connection), every
    request bounded by ``timeout_s``; outcomes in request order."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    next_i = 0
    # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s):
    # a request sent on a connection the server is closing fails with no answer.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=KEEPALIVE_S)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < len(requests):
            i = next_i
            next_i += 1
            outcomes[i] = await send(client, base_url, requests[i], timeout_s)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return [o for o in outcomes if o is not None]


# --------------------------------------------------------------------------- server state

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def read_metrics(base_url: str) -> dict[str, float]:
    """``GET /metrics`` parsed by :func:`parse_metrics`."""
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=30).text)


def counter(metrics: dict[str, float], name: str, **labels: str) -> float:
    """One sample of ``metrics`` (0 when absent)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                  if labels else "")
    return metrics.get(key, 0.0)


def wait_gauges_zero(base_url: str, timeout_s: float) -> dict[str, float]:
    """Poll ``/metrics`` until every gauge of :data:`GAUGES` reads 0, at most ``timeout_s``;
    returns the last reading of those gauges (the caller checks it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(base_url)
        gauges = {g: m.get(g, float("nan")) for g in GAUGES}
        if all(v == 0 for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def process_tree_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and all its descendants (Linux ``/proc``); 0 when
    it is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                rss = next((ln for ln in f if ln.startswith("VmRSS:")), None)
        except OSError:
            continue
        if rss is not None:
            total += int(rss.split()[1]) * 1024
        todo.extend(children.get(p, []))
    return total


def status_counts(outcomes: Sequence[Outcome]) -> Counter[str]:
    """Answers by status (``none`` for no answer, ``disconnect`` for deliberate ones)."""
    c: Counter[str] = Counter()
    for o in outcomes:
        if o.disconnected:
            c["disconnect"] += 1
        else:
            c[str(o.status) if o.status is not None else "none"] += 1
    return c
