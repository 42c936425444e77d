"""Is the grammar hidden? Verify-step time with a JSON-Schema grammar on every request vs none,
with overlap on and off, per batch size (one summary line per configuration).

Step time = wall time per scheduler verify step in steady state (prefills done, CUDA graphs
captured), averaged over ``--steps`` steps; it includes drafting, the verify forward, the
grammar barrier, the tree bitmask build and its application, verification and the D2H copy.
The schema forces long outputs (an array of at least 400 objects), so every request stays
constrained for the whole window.

    PYTHONPATH=$PWD python benchmarks/grammar_overlap.py --device cuda --batch 1 8 32 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaSpec, SamplingParams  # noqa: E402

LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 400, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer"}},
        "required": ["name", "city", "age"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def step_ms(llm: LLM, prompts: list[str], grammar: bool, steps: int) -> tuple[float, float]:
    """Mean verify-step wall time (ms) and committed tokens per step over ``steps`` steps."""
    engine = llm.engine
    sp = SamplingParams(max_tokens=4000, ignore_eos=True,
                        grammar=JsonSchemaSpec(LONG_SCHEMA) if grammar else None)
    for p in prompts:
        engine.add_request(p, sp)
    sched = engine.scheduler
    while sched.waiting or sched.grammar_queue:
        engine.step()
    for _ in range(3):  # warm-up: graph capture for this bucket
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    before = sum(r.spec.committed_tokens for r in sched.running)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(r.spec.committed_tokens for r in sched.running) - before
    for r in list(sched.requests):
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return dt / steps * 1000, tokens / steps / max(len(prompts), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--algorithms", nargs="+", default=["ngram"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    args = ap.parse_args()
    prompts_all = [p for p, _ in extraction_prompts(max(args.batch), seed=3)]
    for algo in args.algorithms:
        for overlap in (True, False):
            llm = LLM(device=args.device, speculative_algorithm=algo, overlap=overlap,
                      num_draft_tokens=args.num_draft_tokens, max_batch_size=max(args.batch))
            for bs in args.batch:
                plain, _ = step_ms(llm, prompts_all[:bs], False, args.steps)
                gram, acc = step_ms(llm, prompts_all[:bs], True, args.steps)
                print(f"grammar_overlap algo={algo} overlap={'on' if overlap else 'off'} "
                      f"bs={bs:<3} N={args.num_draft_tokens} step_ms_no_grammar={plain:.3f} "
                      f"step_ms_json_schema={gram:.3f} ratio={gram / plain:.3f} "
                      f"tokens_per_req_step={acc:.2f}", flush=True)
            del llm


if __name__ == "__main__":
    main()
