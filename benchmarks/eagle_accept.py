"""Accept length of each drafter on the same prompts: the trained EAGLE-3 head beside the others.

Accept length = tokens committed per request per verify step, bonus token included (greedy).
Workloads (prompts the head never trained on):
  sharegpt    held-out ShareGPT first turns (the fixed 5% split of train-eagle), no grammar
  maskbench   the MaskBench cases ``maskbench_e2e.py`` evaluates, under their JSON Schema
  extraction  JSON extraction prompts (``benchmarks/workloads.py``, seed 0) under their schema
              (SmolLM2-135M answers all of them with the format example they end with)
  extraction_no_example  the same prompts without the example (the model extracts each person)
Drafters: ``eagle`` (``--draft-model``, default: the head shipped for the default model),
``ngram``, ``draft_model`` with the target as its own draft (the ceiling), ``none``; shapes:
``tree`` (N=8, depth 4, top-k 2), ``chain`` (depth 4, top-k 1, N=4) and ``chain1`` (one
drafted token). One summary line per
(workload, shape, drafter):

    PYTHONPATH=$PWD python benchmarks/eagle_accept.py --device cuda --num-prompts 64

``--speculative-adaptive off`` measures each drafter's full tree on every step (the engine's
default, ``auto``, shrinks trees where verify rows cost time, as on a CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import (  # noqa: E402
    EXTRACTION_SCHEMA,
    extraction_prompts,
    maskbench_eval_cases,
    schema_prompt,
)
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.config import QUANTIZATION_CHOICES  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.speculative.registry import drafter_names  # noqa: E402
from structspec.training.prompts import sharegpt_held_out_prompts  # noqa: E402

MASKBENCH_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "maskbench"
SHAPES = {"tree": (8, 4, 2), "chain": (4, 4, 1),
          # one drafted token: accept length - 1 = how often the head's top-1 is the target's
          "chain1": (2, 1, 1)}


def workloads(names: list[str], n: int) -> dict[str, list[tuple[str, dict | None]]]:
    """``name -> [(prompt, schema or None)]``, at most ``n`` prompts each."""
    out: dict[str, list[tuple[str, dict | None]]] = {}
    if "sharegpt" in names:
        out["sharegpt"] = [(p, None) for p in sharegpt_held_out_prompts()[:n]]
    if "maskbench" in names:
        out["maskbench"] = [(schema_prompt(c["schema"]), c["schema"])
                            for c in maskbench_eval_cases(MASKBENCH_DIR)[:n]]
    if "extraction" in names:
        out["extraction"] = [(p, EXTRACTION_SCHEMA) for p, _ in extraction_prompts(n, seed=0)]
    if "extraction_no_example" in names:
        out["extraction_no_example"] = [(p, EXTRACTION_SCHEMA) for p, _ in
                                        extraction_prompts(n, seed=0, example=False)]
    return out


def scale_head_scores(temperature: float) -> None:
    """Make every EAGLE drafter of this process rank its tree by ``log_softmax(logp / T)``
    (a benchmark-only wrapper of ``EagleDrafter._logp``; the engine has no such option)."""
    from structspec.speculative.eagle import EagleDrafter

    logp = EagleDrafter._logp

    def scaled(self: EagleDrafter, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logp(self, out) / temperature, dim=-1)

    EagleDrafter._logp = scaled  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None, help="EAGLE head (default: the shipped one)")
    ap.add_argument("--algorithms", nargs="+", default=["eagle", "ngram", "draft_model", "none"],
                    choices=drafter_names())
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "maskbench", "extraction"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--speculative-adaptive", default="auto", choices=["auto", "on", "off"],
                    help="tree sizing (off: every step verifies the drafter's full tree)")
    ap.add_argument("--draft-vocab", nargs="+", default=["auto"], choices=["auto", "full"],
                    help="eagle's --speculative-draft-vocab (several: one eagle run each)")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                    help="the target's weight quantization (the engine's option): none keeps "
                         "float weights, as on CUDA; auto quantizes on CPU")
    ap.add_argument("--head-temperature", type=float, default=1.0,
                    help="divide the EAGLE head's log-probabilities by this before the EAGLE-2 "
                         "ranking (a calibration check of the head's scores; 1: as shipped)")
    args = ap.parse_args()
    if not args.head_temperature > 0:
        ap.error("--head-temperature must be > 0")
    if args.draft_model is not None and not (Path(args.draft_model) / "config.json").is_file():
        ap.error(f"--draft-model: {args.draft_model} is not an EAGLE head folder (no config.json)")
    if args.head_temperature != 1.0:
        scale_head_scores(args.head_temperature)
    model = resolve_model_path(args.model)
    work = workloads(args.workloads, args.num_prompts)
    for shape in args.shapes:
        n, depth, topk = SHAPES[shape]
        for algo, vocab in [(a, v) for a in args.algorithms
                            for v in (args.draft_vocab if a == "eagle" else ["auto"])]:
            if algo == "none" and shape != args.shapes[0]:
                continue
            draft = {"eagle": args.draft_model, "draft_model": model}.get(algo)
            # the target as named (None: the default model, whose shipped head eagle drafts
            # with when --draft-model is not given)
            llm = LLM(args.model, device=args.device, speculative_algorithm=algo, draft_model=draft,
                      num_draft_tokens=n, speculative_depth=depth, speculative_topk=topk,
                      max_batch_size=args.max_batch_size,
                      speculative_adaptive=args.speculative_adaptive,
                      speculative_draft_vocab=vocab, quantization=args.quantization)
            for name, items in work.items():
                params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                         grammar=JsonSchemaConstraint(s) if s else None)
                          for _, s in items]
                t0 = time.perf_counter()
                outs = llm.generate([p for p, _ in items], params)
                dt = time.perf_counter() - t0
                steps = sum(o.spec.verify_steps for o in outs)
                committed = sum(o.spec.committed_tokens for o in outs)
                tokens = sum(len(o.token_ids) for o in outs)
                errors = sum(o.error is not None for o in outs)
                print(f"eagle_accept workload={name} shape={shape} algo={algo} "
                      f"accept_len={committed / max(steps, 1):.2f} prompts={len(items)} "
                      f"tokens={tokens} errors={errors} tok/s={tokens / dt:.0f} "
                      f"adaptive={args.speculative_adaptive} draft_vocab={vocab} "
                      f"quantization={args.quantization}", flush=True)
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
