"""Speculation that pays for itself (issue 22): does turning a drafter on slow a request down?

Batch 1, greedy, one request at a time, median tokens/s over the prompts of each workload:

  extraction  JSON extraction prompts (benchmarks/workloads.py), constrained by the
              extraction JSON Schema: the answer copies the prompt, drafts get accepted
  chat        free chat: held-out ShareGPT first turns of 40-300 characters (the train-eagle split),
              no grammar: drafts are rarely accepted

for every configuration: no drafter, then each drafter (``ngram``, ``eagle`` with the shipped
head) with ``--speculative-adaptive on`` and ``off`` (the fixed tree; and ``auto`` with
``--modes``). Every configuration's engine is built up front and each prompt runs on every
configuration in turn (the order rotating from prompt to prompt), so a change of the machine's
load hits all configurations alike; each engine first runs one warm-up request (not timed) per
workload, so the adaptive runs start with the cost model calibrated, as a serving engine would
be. One summary line per (workload, configuration): the median tok/s, its ratio to no drafter
(``vs_none``: of the medians; ``paired``: the median over prompts of the per-prompt ratio, which
a load change between prompts does not move), the accept length, the mean verified tree size,
the share of steps run as a plain decode, and the host time per committed token of each verify
step phase (``StepTimer``: ``draft`` = propose, ``launch`` = verify forward on the CPU,
``commit`` = commit and the drafter's feature hook, ...).

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


def _params(grammar: Any, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          grammar=JsonSchemaConstraint(grammar) if grammar else None)


def run_one(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, Any]:
    """One timed request: (tok/s, its output)."""
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    dt = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(f"request failed: {out.error}")
    return len(out.token_ids) / dt, out


def summarize(rates: list[float], outs: list[Any], phase_ms: dict[str, float]) -> dict[str, Any]:
    """The line's numbers from one configuration's timed requests of a workload."""
    steps = sum(o.spec.verify_steps for o in outs)
    committed = sum(o.spec.committed_tokens for o in outs)
    nodes = sum(o.spec.mean_tree_nodes * o.spec.verify_steps for o in outs)
    plain = sum(o.spec.steps_without_draft for o in outs)
    tokens = max(sum(len(o.token_ids) for o in outs), 1)
    return {"tok_s": statistics.median(rates), "rates": rates,
            "accept_len": committed / max(steps, 1), "tree": nodes / max(steps, 1),
            "plain": plain / max(steps, 1), "outs": [o.token_ids for o in outs],
            "phase_ms": {k: v / tokens for k, v in phase_ms.items()}}


def run_interleaved(engines: dict[str, LLM], prompts: list[str], grammar: Any,
                    max_tokens: int) -> dict[str, dict[str, Any]]:
    """Batch 1, one request at a time; ``prompts[0]`` only warms every engine up; each later
    prompt runs on every engine in turn, the first engine rotating per prompt."""
    params = _params(grammar, max_tokens)
    names = list(engines)
    for llm in engines.values():
        llm.generate(prompts[0], params)
        llm.engine.scheduler.timer.drain()
    rates: dict[str, list[float]] = {n: [] for n in names}
    outs: dict[str, list[Any]] = {n: [] for n in names}
    phases: dict[str, dict[str, float]] = {n: {} for n in names}
    for i, p in enumerate(prompts[1:]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            llm = engines[name]
            rate, out = run_one(llm, p, params)
            rates[name].append(rate)
            outs[name].append(out)
            for rec in llm.engine.scheduler.timer.drain():
                for k, v in rec.cpu_ms.items():
                    phases[name][k] = phases[name].get(k, 0.0) + v
    return {n: summarize(rates[n], outs[n], phases[n]) for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=5, help="timed prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--algorithms", nargs="+", default=["ngram", "eagle"])
    ap.add_argument("--draft-vocab", nargs="+", default=["auto"], choices=["auto", "full"],
                    help="eagle's --speculative-draft-vocab; several: one eagle configuration "
                         "each (labelled /vocab=...)")
    ap.add_argument("--modes", nargs="+", default=["on", "off"],
                    choices=["off", "on", "auto"])
    ap.add_argument("--kv-capacity-tokens", type=int, default=8192,
                    help="KV cache per engine (batch 1 needs one prompt and its answer; "
                         "every configuration's engine is resident at once)")
    ap.add_argument("--quantization", default=None,
                    help="weights (none = float32, int8, int4; default: the engine's own)")
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
    configs = [("none", "off", "auto")] + [
        (a, m, v) for m in args.modes for a in args.algorithms
        for v in (args.draft_vocab if a == "eagle" else ["auto"])]

    def label(a: str, m: str, v: str) -> str:
        if a == "none":
            return "none"
        return f"{a}/adaptive={m}" + (f"/vocab={v}" if a == "eagle"
                                      and len(args.draft_vocab) > 1 else "")

    engines = {label(a, m, v): LLM(
        args.model, device=args.device, speculative_algorithm=a,
        num_draft_tokens=args.num_draft_tokens, speculative_adaptive=m,
        speculative_draft_vocab=v, kv_capacity_tokens=args.kv_capacity_tokens,
        **({} if args.quantization is None else {"quantization": args.quantization}))
        for a, m, v in configs}
    try:
        for name, (prompts, grammar) in work.items():
            res = run_interleaved(engines, prompts, grammar, args.max_tokens)
            ref = res["none"]
            for label, r in res.items():
                paired = statistics.median(a / b for a, b in zip(r["rates"], ref["rates"],
                                                                  strict=True))
                phases = " ".join(f"{k}={v:.1f}" for k, v in sorted(r["phase_ms"].items())
                                  if v >= 0.05)
                print(f"adaptive_spec workload={name} config={label} tok/s={r['tok_s']:.1f} "
                      f"vs_none={r['tok_s'] / ref['tok_s']:.2f}x paired={paired:.2f}x "
                      f"accept_len={r['accept_len']:.2f} mean_tree={r['tree']:.2f} "
                      f"plain_steps={r['plain']:.0%} same_output={r['outs'] == ref['outs']} "
                      f"ms_per_token[{phases}] load={os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for llm in engines.values():
            llm.close()


if __name__ == "__main__":
    main()
