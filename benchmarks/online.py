"""Online benchmark: N concurrent streaming clients against the OpenAI-compatible server.

Either point it at a running server (``--url``) or let it start one ``structspec serve``
per configuration (``--spec none ngram``; each on a free local port, stopped afterwards).
Every run is bounded by a request count and a wall-clock limit. One summary line per
(configuration, concurrency, workload)::

    python benchmarks/online.py --spec none ngram --concurrency 1 4 --num-requests 16 \\
        --max-tokens 48 --workload mixed

Columns: completed / failed requests, requests/s, completion tokens/s (from ``usage``),
TTFT and end-to-end latency p50/p99 (client side, first content chunk / ``[DONE]``), mean
speculative accept length (``usage.speculative``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person who lives in Paris.",
    "Repeat exactly: alpha beta gamma delta alpha beta gamma delta",
    "Write one sentence about the sea.",
    "The user Maria Lopez (age 34, city Rome) signed up. Summarise her as JSON.",
    "List three colors.",
    "What is 12 times 12? Explain briefly.",
]


def request_body(i: int, workload: str, max_tokens: int) -> dict[str, Any]:
    """The ``i``-th request of a workload (plain, json, regex or mixed)."""
    kind = workload if workload != "mixed" else ("plain", "json", "regex")[i % 3]
    body: dict[str, Any] = {
        "model": "bench", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    elif kind == "regex":
        body["regex"] = r"(yes|no)\. [A-Z][a-z ]{4,40}\."
    return body


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    accept_length: float | None = None
    error: str | None = None


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    """Stream one chat completion; measure TTFT (first content) and latency ([DONE])."""
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Result(False, error=event["error"].get("message"))
                if ttft is None and any(c.get("delta", {}).get("content")
                                        for c in event.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    usage = event["usage"]
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - t0
    spec = (usage or {}).get("speculative") or {}
    return Result(True, ttft, latency, int((usage or {}).get("completion_tokens", 0)),
                  spec.get("accept_length"))


async def run_load(url: str, concurrency: int, num_requests: int, workload: str,
                   max_tokens: int, time_limit_s: float) -> Summary:
    """``num_requests`` requests from ``concurrency`` workers, stopping new ones after
    ``time_limit_s`` (running ones are cancelled at ``2 * time_limit_s``)."""
    summary = Summary()
    next_i = 0
    t0 = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < num_requests and time.perf_counter() - t0 < time_limit_s:
            i = next_i
            next_i += 1
            summary.results.append(await one_request(client, url,
                                                     request_body(i, workload, max_tokens)))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(2 * time_limit_s), limits=limits) as c:
        tasks = [asyncio.create_task(worker(c)) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=2 * time_limit_s)
        for t in pending:
            t.cancel()
    summary.wall_s = time.perf_counter() - t0
    return summary


def pct(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def summary_line(config: str, concurrency: int, workload: str, s: Summary) -> str:
    ok = [r for r in s.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    lats = [r.latency_s for r in ok]
    toks = sum(r.tokens for r in ok)
    acc = [r.accept_length for r in ok if r.accept_length]
    wall = max(s.wall_s, 1e-9)
    return (f"config={config} workload={workload} conc={concurrency} ok={len(ok)} "
            f"failed={len(s.results) - len(ok)} req/s={len(ok) / wall:.3f} "
            f"tok/s={toks / wall:.1f} ttft_p50={pct(ttfts, 0.5):.3f}s "
            f"ttft_p99={pct(ttfts, 0.99):.3f}s lat_p50={pct(lats, 0.5):.3f}s "
            f"lat_p99={pct(lats, 0.99):.3f}s "
            f"accept_len={sum(acc) / len(acc) if acc else float('nan'):.2f} "
            f"wall={s.wall_s:.1f}s")


# --------------------------------------------------------------------------- server control


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(spec: str, extra: list[str], timeout_s: float) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``structspec serve --speculative-algorithm spec`` and wait for /health."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"structspec-bench-{spec}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "structspec", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--speculative-algorithm", spec, "--served-model-name", "bench", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout_s} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="benchmark this running server instead")
    p.add_argument("--spec", nargs="+", default=["none", "ngram"],
                   help="server configs to start (speculative algorithms)")
    p.add_argument("--server-args", default="--max-model-len 2048",
                   help="extra flags for each started server")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--workload", nargs="+", default=["mixed"],
                   choices=["plain", "json", "regex", "mixed"])
    p.add_argument("--num-requests", type=int, default=12, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--time-limit", type=float, default=120.0,
                   help="seconds after which a run stops issuing requests")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    args = p.parse_args(argv)

    configs: list[tuple[str, str | None]] = [("external", args.url)] if args.url else \
        [(s, None) for s in args.spec]
    for name, url in configs:
        proc = log = None
        if url is None:
            proc, url, log = start_server(name, args.server_args.split(), args.startup_timeout)
        try:
            asyncio.run(run_load(url, 1, args.warmup, "mixed", 8, args.time_limit))
            for workload in args.workload:
                for conc in args.concurrency:
                    s = asyncio.run(run_load(url, conc, args.num_requests, workload,
                                             args.max_tokens, args.time_limit))
                    print(summary_line(name, conc, workload, s), flush=True)
                    for r in s.results:
                        if not r.ok:
                            print(f"  error: {r.error}", file=sys.stderr)
                            break
        finally:
            if proc is not None:
                stop_server(proc)
                assert log is not None
                log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
