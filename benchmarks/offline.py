"""Offline throughput of structured generation on the default model.

Prints one summary line per configuration (speculative algorithm x grammar on/off):
requests/s, output tokens/s, mean accept length, stop-finished share and schema validity.

    python benchmarks/offline.py --num-requests 32 --max-tokens 160
    python benchmarks/offline.py --algorithms none ngram --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts  # noqa: E402
from structspec import LLM, FinishReason, JsonSchemaConstraint, SamplingParams  # noqa: E402


def run_config(llm: LLM, prompts: list[str], *, grammar: bool, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens,
                            grammar=JsonSchemaConstraint(EXTRACTION_SCHEMA) if grammar else None)
    llm.generate(prompts[:2], params)  # warm-up (grammar compile, allocator, kernels)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec.verify_steps for o in outs)
    committed = sum(o.spec.committed_tokens for o in outs)
    stopped = [o for o in outs if o.finish_reason is FinishReason.STOP]
    return {
        "req_s": len(outs) / dt,
        "tok_s": tokens / dt,
        "accept_len": committed / steps if steps else 0.0,
        "stop_share": len(stopped) / len(outs),
        "valid": sum(1 for o in stopped if o.schema_valid) if grammar else None,
        "n_stop": len(stopped),
        "seconds": dt,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--algorithms", nargs="+", default=["none", "ngram"],
                    choices=["none", "ngram", "draft_model", "eagle"])
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--no-overlap", action="store_true")
    args = ap.parse_args()
    prompts = [p for p, _ in extraction_prompts(args.num_requests, seed=0)]
    for algo in args.algorithms:
        llm = LLM(args.model, speculative_algorithm=algo, draft_model=args.draft_model,
                  num_draft_tokens=args.num_draft_tokens, device=args.device, dtype=args.dtype,
                  max_batch_size=args.max_batch_size, overlap=not args.no_overlap)
        for grammar in (False, True):
            r = run_config(llm, prompts, grammar=grammar, max_tokens=args.max_tokens)
            valid = f" valid={r['valid']}/{r['n_stop']}" if grammar else ""
            print(f"offline algo={algo:<11} grammar={'json_schema' if grammar else 'none':<11} "
                  f"bs<={args.max_batch_size} n={args.num_requests} "
                  f"req/s={r['req_s']:.2f} tok/s={r['tok_s']:.1f} "
                  f"accept_len={r['accept_len']:.2f} stop={r['stop_share']:.2f}{valid} "
                  f"time_s={r['seconds']:.1f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
