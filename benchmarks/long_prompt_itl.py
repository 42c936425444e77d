"""A long prompt arrives while streams decode (issue 21, chunked prefill): the running
streams' inter-token latency during its prefill, and its TTFT, with chunked prefill, without
it, and with no arrival at all.

``--num-streams`` requests decode (short distinct prompts, greedy, no EOS stop); once each has
emitted ``--warmup-tokens`` tokens a prompt of ``--long-prompt-tokens`` token ids arrives. The
*window* runs from its arrival to its first token; every gap between two consecutive
emissions of a stream that ends inside the window is one ITL sample (a streaming client's
view: the time between two deltas). ``no_arrival`` takes the same number of steps without
the long prompt. Then every request is aborted (the next configuration starts clean).

One engine serves every configuration: each sets its scheduler's chunking policy (read at
every step, exactly what ``--no-chunked-prefill`` / ``--max-num-batched-tokens`` set) and
runs twice, the first time as a warm-up (CUDA graphs, Triton kernels), the second reported.
Each run's long prompt is different random token ids, so nothing is served from the prefix
cache. Prints one line per configuration, then the issue's gate (chunked ITL p99 within 2x of
the no-arrival p99):

    config=chunked budget=512 streams=32 long_prompt_tokens=7000 itl_p50_ms=... \\
        itl_p99_ms=... itl_max_ms=... window_ms=... ttft_ms=... steps=... stream_tokens=... slowest_steps_ms=STEP:MS,... [window_steps_ms=MS,...]

    python benchmarks/long_prompt_itl.py --num-streams 2 --long-prompt-tokens 600  # CPU
    python benchmarks/long_prompt_itl.py --device cuda                              # H200
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# idle OpenMP threads sleep instead of spinning (set before torch loads): on a shared CPU
# spinning threads steal the cores the forward needs (see tests/conftest.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from structspec import LLM, SamplingParams  # noqa: E402

TOPICS = ["the sea", "a lantern", "mountains", "a library", "rain", "a train station",
          "autumn", "a lighthouse", "the desert", "a market", "snow", "a violin"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_once(llm: LLM, args: argparse.Namespace, config: str, budget: int,
             run_id: int) -> dict[str, Any]:
    """One run of the workload under ``config`` (chunked / unchunked / no_arrival)."""
    engine = llm.engine
    sched = engine.scheduler
    sched.chunks.enabled = config != "unchunked"
    sched.chunks.budget_tokens = budget
    stream_params = SamplingParams(max_tokens=args.stream_max_tokens, temperature=0.0,
                                   ignore_eos=True)
    streams = [engine.add_request(
        f"Write a long, calm story about {TOPICS[i % len(TOPICS)]} (story {run_id}-{i}).",
        stream_params, request_id=f"s{run_id}-{i}") for i in range(args.num_streams)]
    emitted: dict[str, list[float]] = {r: [] for r in streams}
    counts = dict.fromkeys(streams, 0)
    step_ms: list[float] = []  # wall time of each engine step (the window's are reported)

    def step() -> list[Any]:
        t0 = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        step_ms.append(1e3 * (t - t0))
        for o in outs:
            if o.request_id in emitted and len(o.token_ids) > counts[o.request_id]:
                counts[o.request_id] = len(o.token_ids)
                emitted[o.request_id].append(t)
        return outs

    while min(counts.values()) < args.warmup_tokens:
        step()
    rng = np.random.default_rng(1000 + run_id)
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 32000
    long_ids = rng.integers(200, min(vocab, 32000), size=args.long_prompt_tokens).tolist()
    tokens_before = sum(counts.values())
    first_window_step = len(step_ms)
    t_arrival = time.perf_counter()
    steps = 0
    ttft_ms = None
    if config == "no_arrival":
        for _ in range(args.no_arrival_steps):
            step()
            steps += 1
    else:
        long_id = engine.add_request(long_ids, SamplingParams(max_tokens=4, temperature=0.0),
                                     request_id=f"long{run_id}")
        while ttft_ms is None:
            for o in step():
                if o.request_id == long_id and o.token_ids:
                    ttft_ms = 1e3 * (time.perf_counter() - t_arrival)
                if o.request_id == long_id and o.error:
                    raise RuntimeError(f"the long prompt failed: {o.error}")
            steps += 1
    t_end = time.perf_counter()
    gaps: list[float] = []
    for times in emitted.values():
        gaps += [1e3 * (b - a) for a, b in zip(times, times[1:], strict=False)
                 if t_arrival < b <= t_end]
    stream_tokens = sum(counts.values()) - tokens_before
    window_steps = step_ms[first_window_step:]
    slowest = sorted(range(len(window_steps)), key=window_steps.__getitem__)[-3:][::-1]
    for rid in list(sched.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return dict(config=config, budget=budget if config == "chunked" else "-",
                itl_p50_ms=statistics.median(gaps) if gaps else 0.0,
                itl_p99_ms=percentile(gaps, 0.99), itl_max_ms=max(gaps, default=0.0),
                window_ms=1e3 * (t_end - t_arrival), ttft_ms=ttft_ms, steps=steps,
                stream_tokens=stream_tokens,
                slowest_steps=",".join(f"{i}:{window_steps[i]:.1f}" for i in slowest),
                window_steps=",".join(f"{v:.1f}" for v in window_steps))


def profiled(llm: LLM, fn: Any) -> dict[str, Any]:
    """``fn()`` under torch.profiler; prints the host time of each prefill and verify step
    (no device sync added) and the top ops by self device time and by self host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sched = llm.engine.scheduler
    host_ms: dict[str, list[float]] = {"prefill": [], "verify": []}
    originals = {"prefill": sched._run_prefill, "verify": sched._run_verify}

    def timed(kind: str) -> Any:
        def run(*a: Any) -> None:
            t = time.perf_counter()
            originals[kind](*a)
            host_ms[kind].append(1e3 * (time.perf_counter() - t))
        return run

    sched._run_prefill, sched._run_verify = timed("prefill"), timed("verify")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    try:
        with profile(activities=activities) as prof:
            r = fn()
    finally:
        del sched._run_prefill, sched._run_verify  # the class methods again
    for kind, vals in host_ms.items():
        if vals:
            print(f"profile host_ms {kind}: n={len(vals)} p50={statistics.median(vals):.2f} "
                  f"max={max(vals):.2f} in_order={' '.join(f'{v:.1f}' for v in vals[:64])}")
    table = prof.key_averages()
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return r


def line(r: dict[str, Any], args: argparse.Namespace) -> str:
    ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.1f}"
    return (f"config={r['config']} budget={r['budget']} streams={args.num_streams} "
            f"long_prompt_tokens={args.long_prompt_tokens} itl_p50_ms={r['itl_p50_ms']:.2f} "
            f"itl_p99_ms={r['itl_p99_ms']:.2f} itl_max_ms={r['itl_max_ms']:.2f} "
            f"window_ms={r['window_ms']:.1f} ttft_ms={ttft} steps={r['steps']} "
            f"stream_tokens={r['stream_tokens']} slowest_steps_ms={r['slowest_steps']}"
            + (f" window_steps_ms={r['window_steps']}" if args.print_steps else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--long-prompt-tokens", type=int, default=7000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="tokens each stream emits before the long prompt arrives")
    p.add_argument("--no-arrival-steps", type=int, default=64,
                   help="steps measured in the no_arrival configuration")
    p.add_argument("--stream-max-tokens", type=int, default=1024)
    p.add_argument("--budgets", type=int, nargs="+", default=None,
                   help="chunked runs' --max-num-batched-tokens (default: the engine's auto)")
    p.add_argument("--configs", nargs="+", default=["no_arrival", "chunked", "unchunked"],
                   choices=["no_arrival", "chunked", "unchunked"])
    p.add_argument("--print-steps", action="store_true",
                   help="print every window step's wall time in order (window_steps_ms=)")
    p.add_argument("--profile", action="store_true",
                   help="profile the reported run of each configuration (torch.profiler: top "
                        "ops by self device and host time; host time per prefill / verify step)")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_batch_size=max(8, args.num_streams + 1), max_model_len=args.max_model_len,
              kv_capacity_tokens=args.num_streams * (args.stream_max_tokens + 64)
              + args.max_model_len + 1024)
    budgets = args.budgets or [llm.engine.config.scheduler.max_num_batched_tokens]
    results: dict[str, dict[str, Any]] = {}
    run_id = 0
    for config in args.configs:
        for budget in (budgets if config == "chunked" else budgets[:1]):
            for warm in range(2):  # the first run warms up, the second is reported
                run_id += 1
                if args.profile and warm == 1:
                    r = profiled(llm, functools.partial(run_once, llm, args, config, budget, run_id))
                else:
                    r = run_once(llm, args, config, budget, run_id)
            print(line(r, args), flush=True)
            results.setdefault(config, r)
    if "chunked" in results and "no_arrival" in results:
        ratio = results["chunked"]["itl_p99_ms"] / max(results["no_arrival"]["itl_p99_ms"],
                                                       1e-9)
        print(f"gate: chunked itl_p99 / no_arrival itl_p99 = {ratio:.2f} "
              f"({'PASS' if ratio <= 2.0 else 'FAIL'}: <= 2.0)", flush=True)
    llm.engine.close()


if __name__ == "__main__":
    main()
