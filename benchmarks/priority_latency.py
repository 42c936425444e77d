"""A short request behind many long ones, first come first served vs priority (issue 21).

``--num-long`` long requests (``--long-tokens`` new tokens each, EOS ignored) arrive at once;
once they have run ``--arrive-after-steps`` engine steps, one short request
(``--short-tokens`` new tokens) arrives. With ``--max-batch-size`` below ``--num-long`` (or a
KV pool that holds fewer of them) the long requests fill the engine, so the short one has to
wait for room:

* ``fcfs``: the short request has the default priority (0, like the long ones): it is
  admitted in arrival order, behind the long requests still waiting;
* ``priority``: it has priority ``--short-priority`` (lower is served first): it is admitted
  first, and a running long request is preempted (its KV freed, recomputed later) when
  there is no batch slot or no KV for it.

One engine serves every configuration (warmed up first); the long requests left when the
short one finishes are aborted (the measurement is the short request's). Prints one line per
configuration:

    config=priority short_priority=-1 short_latency_ms=... short_ttft_ms=... \\
        long_requests=40 long_done=0 preemptions=1 wall_s=...

    python benchmarks/priority_latency.py --num-long 6 --long-tokens 48 --max-batch-size 4
    python benchmarks/priority_latency.py --device cuda            # 40 x 512 behind, H200
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# idle OpenMP threads sleep instead of spinning (set before torch loads; tests/conftest.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from structspec import LLM, SamplingParams  # noqa: E402

LONG_PROMPT = "Write a long story about a lighthouse keeper and the ship she saved (part {n})."
SHORT_PROMPT = "What is the capital of France?"


def run_config(llm: LLM, args: argparse.Namespace, name: str, priority: int) -> str:
    """One configuration over the workload on ``llm``; returns its summary line."""
    engine = llm.engine
    stats0 = engine.stats()
    long = SamplingParams(max_tokens=args.long_tokens, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    long_ids = [engine.add_request(LONG_PROMPT.format(n=i), long, request_id=f"{name}-long-{i}")
                for i in range(args.num_long)]
    short_id: str | None = None
    done: dict[str, Any] = {}
    steps = 0
    while short_id is None or short_id not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if short_id is None and steps >= args.arrive_after_steps:
            short_id = engine.add_request(SHORT_PROMPT, short, request_id=f"{name}-short",
                                          priority=priority)
    for rid in long_ids:  # the measurement is over: the long requests left are dropped
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    out = done[short_id]
    if out.error:
        raise RuntimeError(f"the short request failed: {out.error}")
    latency_ms = 1e3 * (out.latency_s or 0.0)
    ttft_ms = 1e3 * (out.ttft_s or 0.0)
    preemptions = engine.stats()["num_preemptions"] - stats0["num_preemptions"]
    long_done = sum(1 for r in long_ids if r in done)
    return (f"config={name} short_priority={priority} short_latency_ms={latency_ms:.1f} "
            f"short_ttft_ms={ttft_ms:.1f} short_tokens={len(out.token_ids)} "
            f"long_requests={args.num_long} long_tokens={args.long_tokens} "
            f"long_done_before_short={long_done} preemptions={preemptions} "
            f"max_batch_size={args.max_batch_size} wall_s={wall:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-long", type=int, default=40)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--short-tokens", type=int, default=4)
    p.add_argument("--short-priority", type=int, default=-1,
                   help="the short request's priority in the 'priority' configuration")
    p.add_argument("--arrive-after-steps", type=int, default=8,
                   help="engine steps the long requests run before the short one arrives")
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="requests running at once (below --num-long: the rest wait)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument("--speculative-algorithm", default="none")
    p.add_argument("--configs", nargs="+", default=["fcfs", "priority"],
                   choices=["fcfs", "priority"])
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_batch_size=args.max_batch_size, kv_capacity_tokens=args.kv_capacity_tokens,
              speculative_algorithm=args.speculative_algorithm)
    # warm-up: the first steps of a batch of each shape the run uses (CUDA graphs, kernels)
    llm.generate([LONG_PROMPT.format(n=-i) for i in range(args.max_batch_size)],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for cfg in args.configs:
        print(run_config(llm, args, cfg, 0 if cfg == "fcfs" else args.short_priority),
              flush=True)
    llm.close()
    del llm
    gc.collect()


if __name__ == "__main__":
    main()
