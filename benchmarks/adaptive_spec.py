"""Speculation that pays for itself (issue 22): does turning a drafter on slow a request down?

Batch 1, greedy, one request at a time, median tokens/s over the prompts of each workload:

  extraction  JSON extraction prompts (benchmarks/workloads.py), constrained by the
              extraction JSON Schema: the answer copies the prompt, drafts get accepted
  chat        free chat: held-out ShareGPT first turns of 40-300 characters (the train-eagle split),
              no grammar: drafts are rarely accepted

for every configuration: no drafter, then each drafter (``ngram``, ``eagle`` with the shipped
head) with ``--speculative-adaptive off`` (the fixed tree) and ``on`` (and ``auto`` with
``--modes``). One summary line per (workload, configuration): the median tok/s, its ratio to
no drafter, the accept length, the mean verified tree size and the share of steps run as a
plain decode. Each engine first runs one warm-up request (not timed) per workload, so
the adaptive runs start with the cost model calibrated, as a serving engine would be.

    PYTHONPATH=. python benchmarks/adaptive_spec.py --device cpu --prompts 5 --max-tokens 96
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts
from structspec import LLM, JsonSchemaConstraint, SamplingParams
from structspec.training.prompts import sharegpt_held_out_prompts


def chat_prompts(n: int) -> list[str]:
    """The first ``n + 1`` held-out ShareGPT prompts of 40 to 300 characters (one is the
    warm-up): a question or a request that gets a free-form answer."""
    return [p for p in sharegpt_held_out_prompts() if 40 <= len(p) <= 300][: n + 1]


def run_workload(llm: LLM, prompts: list[str], grammar: Any, max_tokens: int) -> dict[str, Any]:
    """One request at a time (batch 1); the first prompt only warms up."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            grammar=JsonSchemaConstraint(grammar) if grammar else None)
    llm.generate(prompts[0], params)
    rates, steps, committed, nodes, plain, outs = [], 0, 0, 0.0, 0, []
    for p in prompts[1:]:
        t0 = time.perf_counter()
        out = llm.generate(p, params)[0]
        dt = time.perf_counter() - t0
        if out.error:
            raise RuntimeError(f"request failed: {out.error}")
        rates.append(len(out.token_ids) / dt)
        s = out.spec
        steps += s.verify_steps
        committed += s.committed_tokens
        nodes += s.mean_tree_nodes * s.verify_steps
        plain += s.steps_without_draft
        outs.append(out.token_ids)
    return {"tok_s": statistics.median(rates), "accept_len": committed / max(steps, 1),
            "tree": nodes / max(steps, 1), "plain": plain / max(steps, 1), "outs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=5, help="timed prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--algorithms", nargs="+", default=["ngram", "eagle"])
    ap.add_argument("--modes", nargs="+", default=["on", "off"],
                    choices=["off", "on", "auto"])
    ap.add_argument("--workloads", nargs="+", default=["extraction", "chat"],
                    choices=["extraction", "chat"])
    args = ap.parse_args()
    work: dict[str, tuple[list[str], Any]] = {}
    if "extraction" in args.workloads:
        work["extraction"] = ([p for p, _ in extraction_prompts(args.prompts + 1, seed=7)],
                              EXTRACTION_SCHEMA)
    if "chat" in args.workloads:
        work["chat"] = (chat_prompts(args.prompts), None)
    print(f"adaptive_spec device={args.device} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.2f} prompts={args.prompts} max_tokens={args.max_tokens}",
          flush=True)
    # the modes in the order given, each over every drafter: the first mode's lines come first
    configs = [("none", "off")] + [(a, m) for m in args.modes for a in args.algorithms]
    base: dict[str, dict[str, Any]] = {}
    for algo, mode in configs:
        llm = LLM(args.model, device=args.device, speculative_algorithm=algo,
                  num_draft_tokens=args.num_draft_tokens, speculative_adaptive=mode)
        for name, (prompts, grammar) in work.items():
            r = run_workload(llm, prompts, grammar, args.max_tokens)
            ref = base.setdefault(name, r)
            same = r["outs"] == ref["outs"]
            label = "none" if algo == "none" else f"{algo}/adaptive={mode}"
            print(f"adaptive_spec workload={name} config={label} tok/s={r['tok_s']:.1f} "
                  f"vs_none={r['tok_s'] / ref['tok_s']:.2f}x accept_len={r['accept_len']:.2f} "
                  f"mean_tree={r['tree']:.2f} plain_steps={r['plain']:.0%} "
                  f"same_output={same} load={os.getloadavg()[0]:.2f}", flush=True)
        llm.close()
        del llm


if __name__ == "__main__":
    main()
