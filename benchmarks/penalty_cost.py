"""What do sampling penalties cost per verify step? Step time with penalised requests vs the
same batch without penalties, per batch size (one summary line per configuration).

Configurations (``--configs``):

- ``neutral``: every request has ``logit_bias={0: 0.0}``, which changes no logit: the whole
  penalty pass runs (the penalised post-forward CUDA graph: per-row path counts, the
  formula, the scatter back, the count update) while the outputs, and so the work of every
  other phase, stay those of the baseline. Its ratio is the pure cost of the pass.
- ``frequency``: ``frequency_penalty=0.3`` on every request (outputs change a little).
- ``all``: presence 0.3, frequency 0.3, repetition 1.1 and a logit bias on every request.
- ``half``: ``all`` on every other request (a mixed batch).

Step time as in ``grammar_overlap.py`` (steady state, CUDA graphs captured, CUDA-event time
of the window / steps), on its ``records`` workload (copied JSON records under the long
schema, so that the n-gram drafter proposes full trees), greedy. Baseline and penalised runs
alternate ``--repeats`` times; the pair with the median ratio is printed.

    PYTHONPATH=$PWD python benchmarks/penalty_cost.py --device cuda --batch 1 32 64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA, record_prompts, step_ms  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "neutral": dict(logit_bias={0: 0.0}),
    "frequency": dict(frequency_penalty=0.3),
    "all": dict(presence_penalty=0.3, frequency_penalty=0.3, repetition_penalty=1.1,
                logit_bias={28: -2.0, 30: 1.0}),
}


def batch_params(config: str, n: int, max_tokens: int, grammar: bool) -> list[SamplingParams]:
    """Per-request parameters of ``config`` (``none``: the baseline; ``half``: ``all`` on
    every other request)."""
    g = JsonSchemaConstraint(LONG_SCHEMA) if grammar else None
    out = []
    for i in range(n):
        if config == "none" or (config == "half" and i % 2):
            pen: dict[str, Any] = {}
        else:
            pen = CONFIGS["all" if config == "half" else config]
        out.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, grammar=g, **pen))
    return out


def measure(llm: LLM, prompts: list[Any], config: str, args: argparse.Namespace,
            max_tokens: int) -> dict[str, float]:
    """``grammar_overlap.step_ms`` of the batch under ``config``."""
    params = batch_params(config, len(prompts), max_tokens, not args.no_grammar)
    return step_ms(llm, prompts, not args.no_grammar, args.steps, params=params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--configs", nargs="+", default=["neutral", "frequency", "all", "half"],
                    choices=["neutral", "frequency", "all", "half"])
    ap.add_argument("--algorithm", default="ngram")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-grammar", action="store_true",
                    help="no JSON Schema on the requests (default: the long schema)")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="eager verify and post-forward work (the penalty pass too)")
    args = ap.parse_args()
    max_tokens = (args.steps + 8) * args.num_draft_tokens + 64
    llm = LLM(device=args.device, speculative_algorithm=args.algorithm,
              num_draft_tokens=args.num_draft_tokens, max_batch_size=max(args.batch),
              cuda_graph=not args.no_cuda_graph)
    prompts_all = record_prompts(llm, max(args.batch))
    for bs in args.batch:
        for config in args.configs:
            pairs = []
            for _ in range(args.repeats):  # alternate: a drift of the host hits both sides
                base = measure(llm, prompts_all[:bs], "none", args, max_tokens)
                pen = measure(llm, prompts_all[:bs], config, args, max_tokens)
                pairs.append((pen["event_ms"] / base["event_ms"], base, pen))
            ratios = sorted(p[0] for p in pairs)
            pairs.sort(key=lambda p: p[0])
            ratio, base, pen = pairs[len(pairs) // 2]
            print(f"penalty_cost algo={args.algorithm} bs={bs:<3} "
                  f"N={llm.engine.drafter.num_nodes} config={config} "
                  f"graph={'on' if llm.engine.runner.use_cuda_graph else 'off'} "
                  f"grammar={'off' if args.no_grammar else 'json_schema'} "
                  f"step_ms_none={base['event_ms']:.3f} step_ms_penalised={pen['event_ms']:.3f} "
                  f"ratio={ratio:.3f} ratio_min={ratios[0]:.3f} ratio_max={ratios[-1]:.3f} "
                  f"median_ratio={statistics.median(ratios):.3f} repeats={len(pairs)} "
                  f"tokens_per_req_step_none={base['tokens_per_req_step']:.2f} "
                  f"tokens_per_req_step_penalised={pen['tokens_per_req_step']:.2f} "
                  f"gpu_busy_none={base.get('gpu_busy_ms', float('nan')):.3f} "
                  f"gpu_busy_penalised={pen.get('gpu_busy_ms', float('nan')):.3f}", flush=True)
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
