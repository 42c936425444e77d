"""Reliability under load (issue 17, long form): many concurrent streaming clients mixing
grammars, mid-stream disconnects and bad inputs against one server, twice.

It starts its own ``structspec serve`` on a free loopback port (default model, CPU unless
``--device`` says otherwise) and runs the same seeded mix two times, so that memory growth
between the runs shows. Per run it prints one line: requests sent, answers by status,
problems (5xx, no answer, a stream without exactly one ``[DONE]``, a 4xx that does not name
its field, a valid request refused), structured outputs that finished with ``stop`` and do
not validate, p50 / p99 latency of the answered good requests, the server's RSS (front end
+ engine + workers) before and after, and whether the queue gauges came back to 0::

    python benchmarks/reliability_load.py                       # 200 clients, 1,000 requests
    python benchmarks/reliability_load.py --clients 40 --requests 100

Every request is bounded by ``--request-timeout``; the gauges are polled for at most
``--idle-timeout`` seconds. The exit status is 1 when any run had a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hostile_requests import hostile_requests  # noqa: E402
from benchmarks.online import pct, start_server, stop_server  # noqa: E402
from benchmarks.reliability_client import (  # noqa: E402
    Outcome,
    problems,
    process_tree_rss_bytes,
    run_requests,
    status_counts,
    wait_gauges_zero,
)
from benchmarks.reliability_requests import mixed_requests, output_problem  # noqa: E402

MODEL = "bench"  # --served-model-name of the server start_server() starts


def invalid_outputs(outcomes: Sequence[Outcome]) -> int:
    """Choices that finished with ``stop`` under a grammar and do not validate."""
    bad = 0
    for o in outcomes:
        if o.status != 200 or o.disconnected:
            continue
        for i, reasons in o.finishes.items():
            if reasons and reasons[0] == "stop" and \
                    output_problem(o.request.kind, o.texts.get(i, "")) is not None:
                bad += 1
    return bad


def run_line(run: int, outcomes: Sequence[Outcome], wall_s: float, rss_before: int,
             rss_after: int, gauges: dict[str, float]) -> str:
    """The summary line of one run."""
    statuses = status_counts(outcomes)
    found = [p for o in outcomes for p in problems(o)]
    lats = [o.latency_s for o in outcomes
            if o.status == 200 and not o.disconnected and not o.request.expect_error]
    gauges_ok = all(v == 0 for v in gauges.values())
    return (f"run={run} sent={len(outcomes)} answers={dict(sorted(statuses.items()))} "
            f"problems={len(found)} invalid_structured={invalid_outputs(outcomes)} "
            f"lat_p50={pct(lats, 0.5):.2f}s lat_p99={pct(lats, 0.99):.2f}s "
            f"wall={wall_s:.1f}s rss_before={rss_before / 2**20:.0f}MiB "
            f"rss_after={rss_after / 2**20:.0f}MiB "
            f"gauges_zero={'yes' if gauges_ok else gauges}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=1000, help="requests per run")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--disconnect-fraction", type=float, default=0.15)
    ap.add_argument("--bad-fraction", type=float, default=0.15,
                    help="bad inputs: half bad schemas, half hostile catalogue requests")
    ap.add_argument("--n2-fraction", type=float, default=0.2, help="requests with n = 2")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="seconds to wait for the queue gauges to reach 0 after a run")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--show-problems", type=int, default=10, help="problem lines to print")
    args = ap.parse_args(argv)

    extra = ["--device", args.device, "--max-batch-size", str(args.max_batch_size)]
    proc, url, log = start_server("none", extra, args.startup_timeout)
    failed = False
    try:
        catalogue = hostile_requests(args.seed)  # default model: vocabulary 49152, 8192 ctx
        plan = mixed_requests(args.requests, args.seed, hostile=catalogue,
                              disconnect_fraction=args.disconnect_fraction,
                              bad_fraction=args.bad_fraction, n2_fraction=args.n2_fraction,
                              max_tokens=args.max_tokens, model=MODEL)
        for run in range(1, args.runs + 1):
            rss_before = process_tree_rss_bytes(proc.pid)
            t0 = time.perf_counter()
            outcomes = asyncio.run(run_requests(url, plan, concurrency=args.clients,
                                                timeout_s=args.request_timeout))
            wall_s = time.perf_counter() - t0
            gauges = wait_gauges_zero(url, args.idle_timeout)
            rss_after = process_tree_rss_bytes(proc.pid)
            print(run_line(run, outcomes, wall_s, rss_before, rss_after, gauges), flush=True)
            found = [p for o in outcomes for p in problems(o)]
            for p in found[:args.show_problems]:
                print("  problem:", p, flush=True)
            failed |= bool(found) or any(v != 0 for v in gauges.values()) or \
                invalid_outputs(outcomes) > 0
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
