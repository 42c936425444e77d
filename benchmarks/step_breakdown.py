"""Where the time of one end-to-end batch goes: peer_compare's ``ngram+json`` row, broken down.

Runs the JSON-extraction workload of ``peer_compare.py`` (n-gram speculation, JSON Schema,
overlap on) at one batch size, ``--repeats`` times after a warm-up, and prints one line per
repeat: wall seconds, tokens/s, verify steps, accept length, the mean host time per step phase
and the mean GPU intervals (``StepTimer.summary``), and the wall time outside verify steps
(admission, prefill, grammar setup). Works on any checkout that has ``scheduler.timer``, so two
commits can be compared phase by phase (``ab_compare.py`` runs it in each).

    PYTHONPATH=$PWD python benchmarks/step_breakdown.py --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structspec  # noqa: E402
from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts  # noqa: E402
from structspec import LLM, SamplingParams  # noqa: E402

# The constraint class was renamed in the architecture rework; older checkouts have the old name.
JsonSchema = getattr(structspec, "JsonSchemaConstraint", None) or structspec.JsonSchemaSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prompts = [p for p, _ in extraction_prompts(args.num_prompts, seed=0)]
    work = (prompts * (-(-args.batch // len(prompts))))[:args.batch]
    llm = LLM(speculative_algorithm="ngram", num_draft_tokens=8, device=args.device,
              max_batch_size=64)
    sp = SamplingParams(max_tokens=args.max_tokens, grammar=JsonSchema(EXTRACTION_SCHEMA))
    if llm.engine.runner.device.type == "cuda":
        llm.engine.warmup_cuda_graphs(batch_sizes=[args.batch])
    llm.generate(work, sp)
    timer = llm.engine.scheduler.timer
    for rep in range(args.repeats):
        timer.reset()
        t0 = time.perf_counter()
        outs = llm.generate(work, sp)
        wall_s = time.perf_counter() - t0
        s = timer.summary()
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.spec.verify_steps for o in outs)
        acc = sum(o.spec.committed_tokens for o in outs) / max(steps, 1)
        in_steps_s = s.get("wall_ms", 0.0) * s["steps"] / 1e3
        phases = " ".join(f"{k[4:-3]}={v:.2f}" for k, v in s.items()
                          if k.startswith("cpu_"))
        gpu = " ".join(f"{k[:-3]}={v:.2f}" for k, v in s.items()
                       if k.startswith("gpu_") or k.startswith("pool_"))
        print(f"step_breakdown bs={args.batch} rep={rep} wall_s={wall_s:.3f} "
              f"tok/s={tokens / wall_s:.1f} steps={int(s['steps'])} accept_len={acc:.2f} "
              f"step_ms={s.get('wall_ms', 0.0):.2f} outside_steps_s={wall_s - in_steps_s:.3f} "
              f"cpu_ms[{phases}] gpu_ms[{gpu}]", flush=True)


if __name__ == "__main__":
    main()
