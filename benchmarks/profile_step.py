"""Host profile (cProfile, sorted by own time) of steady-state verify steps on one config.

    PYTHONPATH=$PWD python benchmarks/profile_step.py --algorithm ngram --batch 1 --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA, draft_for  # noqa: E402
from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", default="ngram")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--grammar", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    llm = LLM(args.model, speculative_algorithm=args.algorithm, max_batch_size=args.batch,
              load_format=args.load_format, draft_model=draft_for(args.algorithm, args))
    eng = llm.engine
    sp = SamplingParams(max_tokens=(args.steps + 8) * 8 + 64, ignore_eos=True,
                        grammar=JsonSchemaConstraint(LONG_SCHEMA) if args.grammar else None)
    for p, _ in extraction_prompts(args.batch, seed=3):
        eng.add_request(p, sp)
    # until every request runs (a grammar compiles off the step loop, so the first steps
    # may have nothing to run), then the graphs of this batch size, then a few warm steps
    deadline = time.perf_counter() + 600
    while len(eng.scheduler.running) < args.batch:
        eng.step()
        if time.perf_counter() > deadline:
            raise SystemExit(f"{len(eng.scheduler.running)} of {args.batch} requests running "
                             "after 600 s")
    eng.warmup_cuda_graphs(batch_sizes=[args.batch])
    for _ in range(5):
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    print(f"# {args.algorithm} batch={args.batch} grammar={args.grammar}: "
          + " ".join(f"{k}={v:.3f}" for k, v in eng.step_stats().items()))
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
