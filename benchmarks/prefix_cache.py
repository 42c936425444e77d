"""Shared-prefix workload with the prefix cache on and off (issue 21): TTFT and throughput.

N chat requests share one long system prompt (instructions plus the JSON Schema of the answer,
which also constrains the output) and differ only in a short user question, as in tool-calling
and extraction traffic. All N arrive at once; ``--max-batch-size`` of them run together, so
a request's TTFT counts its wait for a batch slot as well as its prefill. One engine per
configuration, each warmed up first with an unrelated request (the system prompt is not
pre-cached: the first wave's prefills miss; the schema is compiled by the warm-up). Prints one line per configuration:

    prefix_cache=on requests=32 prompt_tokens=... cached_frac=0.88 ttft_p50_ms=... \\
        ttft_p99_ms=... throughput_tok_s=... req_s=... wall_s=...

    python benchmarks/prefix_cache.py                                   # CPU, small
    python benchmarks/prefix_cache.py --device cuda --num-requests 256 --max-batch-size 64 \\
        --system-tokens 2048 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
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

from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "intent": {"type": "string", "enum": ["order_status", "return", "shipping", "billing",
                                               "other"]},
        "order_id": {"type": ["string", "null"]},
        "urgent": {"type": "boolean"},
        "reply": {"type": "string"},
    },
    "required": ["intent", "order_id", "urgent", "reply"],
    "additionalProperties": False,
}

RULES = [
    "You are the support assistant of an online shop that sells shoes, bags and jackets.",
    "Classify the customer's message into one intent and write a short, friendly reply.",
    "Never promise refunds; returns are accepted within 30 days with the receipt.",
    "Shipping takes 2 to 5 working days inside the EU and 7 to 12 days elsewhere.",
    "Orders ids look like SHOP-12345; copy the id when the customer gives one, else null.",
    "Mark the message urgent when the customer mentions a deadline, a gift or a wedding.",
    "Billing questions about VAT, invoices or double charges go to the billing intent.",
    "Keep replies under two sentences, in the customer's language, without emojis.",
]

QUESTIONS = [
    "Where is my order SHOP-{n:05d}? It has been a week.",
    "Can I return the boots I bought {n} days ago?",
    "Do you ship to Norway? I need a jacket by the {n}th.",
    "I was charged twice for order SHOP-{n:05d}, please help.",
    "Is the leather bag model {n} back in stock soon?",
    "My parcel SHOP-{n:05d} arrived damaged, what now?",
]


def system_prompt(llm: LLM, target_tokens: int) -> str:
    """The rules, repeated with numbered variations up to about ``target_tokens`` tokens, then
    the answer's JSON Schema."""
    tok = llm.tokenizer
    schema = json.dumps(SCHEMA)
    parts = ["Answer with one JSON object that follows this JSON Schema: " + schema]
    i = 0
    while len(tok.encode(" ".join(parts))) < target_tokens:
        parts.insert(-1, f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return "\n".join(parts)


def run(args: argparse.Namespace, enable: bool) -> str:
    """One engine with the cache on or off over the workload; returns its summary line."""
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_batch_size=args.max_batch_size, kv_capacity_tokens=args.kv_capacity_tokens,
              speculative_algorithm=args.speculative_algorithm,
              enable_prefix_caching=enable)
    system = system_prompt(llm, args.system_tokens)
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(n=i + 7)}]
             for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                            grammar=JsonSchemaConstraint(SCHEMA))
    # warm-up on another prefix; it also compiles the schema (cached), so the timed run
    # measures serving, not the grammar compile
    llm.generate([[{"role": "user", "content": "Say hello."}]],
                 SamplingParams(max_tokens=4, temperature=0.0, grammar=params.grammar))
    t0 = time.perf_counter()
    outs = llm.generate(chats, params)
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    ttft_ms = sorted(1e3 * (o.ttft_s or 0.0) for o in outs)
    p99 = ttft_ms[min(len(ttft_ms) - 1, int(0.99 * len(ttft_ms)))]
    prompt_tokens = sum(o.num_prompt_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    out_tokens = sum(o.num_completion_tokens for o in outs)
    llm.engine.close()
    del llm
    gc.collect()
    return (f"prefix_cache={'on' if enable else 'off'} requests={len(outs)} "
            f"prompt_tokens={prompt_tokens} cached_frac={cached / prompt_tokens:.2f} "
            f"ttft_p50_ms={statistics.median(ttft_ms):.1f} ttft_p99_ms={p99:.1f} "
            f"throughput_tok_s={out_tokens / wall:.1f} req_s={len(outs) / wall:.2f} "
            f"wall_s={wall:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="requests running at once (the rest wait for a slot)")
    p.add_argument("--system-tokens", type=int, default=512,
                   help="approximate length of the shared system prompt, schema included")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument("--speculative-algorithm", default="none")
    p.add_argument("--configs", nargs="+", default=["off", "on"], choices=["on", "off"])
    args = p.parse_args()
    for cfg in args.configs:
        print(run(args, cfg == "on"), flush=True)


if __name__ == "__main__":
    main()
