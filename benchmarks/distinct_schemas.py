"""Many-schema traffic: N requests, each with its own MaskBench JSON Schema, per worker count.

Every request brings a grammar no other request uses, so each one must reach a mask worker
before the worker can build that request's masks (MaskWorkerPool, "Shipping grammars"). Prints
one summary line per speculative algorithm and grammar-worker count: wall time, output
tokens/s, and the time the step loop spent shipping grammars (``ship_step_ms``: placing,
queueing, reading acknowledgements; the serialization runs on the pool's shipping thread,
``ship_thread_ms``).

The grammars are compiled before the clock starts (``--no-precompile`` keeps the compile in
the timed run), so the lines compare serving, not compiling. Schemas whose compile took over
``--max-compile-s`` (tests/data/maskbench/compile_seconds.json) or that fail to compile are
skipped. ``--prompt schema`` asks for an instance with the schema in the prompt (as
maskbench_e2e.py; prompts of ~0.3-3k tokens); the default ``short`` prompt names the task only
(the grammar still constrains every token), which keeps a CPU run's prefill small.

    python benchmarks/distinct_schemas.py                       # CPU: 16 requests, batch 8
    python benchmarks/distinct_schemas.py --device cuda --prompt schema --num-requests 300 \\
        --max-batch-size 64 --max-tokens 512 --workers 0 8 --algorithms none ngram
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grammar_overlap import (  # noqa: E402
    WALKS_ORDER_HELP,
    breakdown,
    set_build_order,
)
from benchmarks.workloads import maskbench_cases, schema_prompt  # noqa: E402
from structspec import LLM, FinishReason, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.grammar.errors import GrammarError  # noqa: E402

#: ``--prompt short``: the task without the schema (the grammar constrains the output anyway)
SHORT_PROMPT = "Reply with a small, realistic JSON object. Reply with the JSON only."


def pick_schemas(data: Path, n: int, max_compile_s: float) -> list[dict[str, Any]]:
    """The first ``n`` MaskBench schemas (by name) whose recorded compile time is at most
    ``max_compile_s``; raises ValueError when fewer exist."""
    timing_path = data / "compile_seconds.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    cases = [c["schema"] for c in maskbench_cases(data)
             if timing.get(c["_name"], 0.0) <= max_compile_s]
    if len(cases) < n:
        raise ValueError(f"--num-requests {n}: only {len(cases)} MaskBench schemas compile in "
                         f"<= {max_compile_s} s; raise --max-compile-s")
    return cases


def run_one(args: argparse.Namespace, algo: str, workers: int,
            schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One engine (``workers`` grammar mask workers, drafter ``algo``) over the schemas;
    returns the schemas it kept (those that compile) and the summary numbers."""
    llm = LLM(args.model, device=args.device, dtype=args.dtype, speculative_algorithm=algo,
              num_draft_tokens=args.num_draft_tokens, max_batch_size=args.max_batch_size,
              kv_capacity_tokens=args.kv_capacity_tokens, grammar_workers=workers,
              grammar_compile_timeout_s=args.compile_timeout)
    engine = llm.engine
    set_build_order(engine, args.walks_order)
    pool = engine.scheduler.mask_pool  # kept: the scheduler drops it if a worker fails
    compile_s = 0.0
    if args.precompile:
        t0 = time.perf_counter()
        kept: list[dict[str, Any]] = []
        todo = list(schemas)
        while todo and len(kept) < args.num_requests:
            # as many as still needed, at once (the backend's compile threads run them in
            # parallel); a schema that fails (not enforceable) makes room for the next one
            wave, todo = todo[: args.num_requests - len(kept)], todo[args.num_requests - len(kept):]
            futures = [engine.grammar.submit(JsonSchemaConstraint(s)) for s in wave]
            for schema, fut in zip(wave, futures, strict=True):
                try:
                    fut.result(timeout=args.compile_timeout)
                except GrammarError:
                    continue
                kept.append(schema)
        schemas = kept
        compile_s = time.perf_counter() - t0
    schemas = schemas[: args.num_requests]
    prompts = [schema_prompt(s) if args.prompt == "schema" else SHORT_PROMPT for s in schemas]
    params = [SamplingParams(max_tokens=args.max_tokens, grammar=JsonSchemaConstraint(s))
              for s in schemas]
    engine.step_stats(reset=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    stats = engine.step_stats()
    summary = {
        "algo": algo, "workers": workers, "n": len(outs), "wall_s": wall_s,
        "tok_s": tokens / wall_s, "tokens": tokens,
        "stop": sum(o.finish_reason is FinishReason.STOP for o in outs),
        "errors": sum(o.error is not None for o in outs),
        # what the errors were (the first 60 characters of each distinct message, counted)
        "error_kinds": dict(Counter((o.error or "")[:60] for o in outs if o.error)) or None,
        "ship_step_ms": getattr(pool, "ship_ms", 0.0),
        "ship_thread_ms": getattr(pool, "ship_thread_ms", 0.0),
        "shipped": getattr(pool, "num_shipped", 0),
        "pool_builds": getattr(pool, "num_builds", 0),
        "pool_alive": engine.scheduler.mask_pool is not None if workers else None,
        "step_wall_ms": stats.get("wall_ms", 0.0), "steps": stats.get("steps", 0),
        "compile_s": compile_s,
        "breakdown": breakdown("step", stats),
    }
    llm.close()
    del llm, engine, pool
    gc.collect()
    return schemas, summary


def print_summary(args: argparse.Namespace, s: dict[str, Any]) -> None:
    """One summary line for one run (and the errors by message, if any)."""
    print(f"distinct_schemas algo={s['algo']} workers={s['workers']} n={s['n']} "
          f"batch={args.max_batch_size} max_tokens={args.max_tokens} walks={args.walks_order} "
          f"wall_s={s['wall_s']:.2f} tok_s={s['tok_s']:.1f} tokens={s['tokens']} "
          f"stop={s['stop']} errors={s['errors']} "
          f"ship_step_ms={s['ship_step_ms']:.2f} "
          f"ship_thread_ms={s['ship_thread_ms']:.1f} shipped={s['shipped']} "
          f"pool_builds={s['pool_builds']} pool_alive={s['pool_alive']} "
          f"steps={s['steps']} step_wall_ms={s['step_wall_ms']:.2f} "
          f"compile_s={s['compile_s']:.1f} {s['breakdown']}", flush=True)
    if s["error_kinds"]:
        print(f"  errors by message: {s['error_kinds']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT / "tests" / "data" / "maskbench"))
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2],
                    help="grammar mask worker counts to compare (0 = in the engine process)")
    ap.add_argument("--algorithms", nargs="+", default=["none"],
                    help="speculative algorithms (registered drafter names)")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-capacity-tokens", type=int, default=None)
    ap.add_argument("--prompt", choices=["short", "schema"], default="short",
                    help="short: the task only; schema: the schema in the prompt (long prefill)")
    ap.add_argument("--max-compile-s", type=float, default=2.0,
                    help="skip schemas whose recorded compile time is longer")
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    ap.add_argument("--no-precompile", dest="precompile", action="store_false",
                    help="compile inside the timed run (as live traffic would)")
    ap.add_argument("--walks-order", default="auto", choices=["auto", "before", "after"],
                    help=WALKS_ORDER_HELP)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per configuration, the worker order reversed every other round; "
                         "a median line per configuration follows when > 1")
    ap.add_argument("--warmup-runs", type=int, default=None,
                    help="runs before the measured ones, not counted (the first engine of a "
                         "process pays the kernel compiles and graph captures: on the H200 "
                         "it ran at 0.6-0.7x of the later ones); default 1 on CUDA, 0 on CPU")
    args = ap.parse_args()
    if args.warmup_runs is None:
        args.warmup_runs = 1 if args.device == "cuda" else 0
    if args.num_requests < 1 or args.max_batch_size < 1 or args.max_tokens < 1:
        ap.error("--num-requests, --max-batch-size and --max-tokens must be >= 1")
    if any(w < 0 for w in args.workers):
        ap.error("--workers: counts must be >= 0")
    if args.repeats < 1:
        ap.error("--repeats: must be >= 1")
    schemas = pick_schemas(Path(args.data), args.num_requests, args.max_compile_s)
    tok_s: dict[tuple[str, int], list[float]] = {}
    for _ in range(max(args.warmup_runs, 0)):
        schemas, s = run_one(args, args.algorithms[0], args.workers[0], schemas)
        print(f"# warm-up run (not counted): {s['tok_s']:.1f} tok/s", flush=True)
    for algo in args.algorithms:
        for rep in range(args.repeats):
            # alternate the order so that a drift of the machine (clocks, other jobs) does not
            # favour whichever configuration runs first
            for workers in args.workers if rep % 2 == 0 else args.workers[::-1]:
                schemas, s = run_one(args, algo, workers, schemas)
                tok_s.setdefault((algo, workers), []).append(s["tok_s"])
                print_summary(args, s)
    if args.repeats > 1:
        for (algo, workers), vals in tok_s.items():
            print(f"distinct_schemas_median algo={algo} workers={workers} runs={len(vals)} "
                  f"tok_s={statistics.median(vals):.1f} "
                  f"all={' '.join(f'{v:.1f}' for v in vals)}", flush=True)


if __name__ == "__main__":
    main()
