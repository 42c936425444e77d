"""Quantized logits against float32 on the float32 path's own greedy tokens (issue 22 gate).

1. The float32 engine (``quantization="none"``) answers every prompt greedily.
2. Each prompt + answer is teacher-forced through the float32 model and through each
   quantized copy (:func:`structspec.models.quantize.quantize_model`) in one prefill forward
   (:class:`structspec.training.features.TargetFeatureExtractor`), and the logits of the
   positions that predict the answer's tokens are compared: argmax agreement (the share of
   positions whose quantized argmax is the float32 greedy token; the issue's gate is >= 99%
   over 50 prompts), mean and max of the per-position max-abs logit difference.
3. ``--check-json`` also runs each engine mode greedily with the extraction JSON Schema and
   counts the outputs that parse with every field of the right type.

Plans are ``LAYERS[-GROUP]:LM_HEAD``: ``int8:int8`` (int8 layers and LM head), ``int4-32:none``
(int4 groups of 32, float32 LM head), ...; ``--plans engine`` measures what
``--quantization int8`` / ``int4`` build.

    PYTHONPATH=$PWD python benchmarks/quant_accuracy.py --num-prompts 50 --max-tokens 64 \
        --plans int8:int8,int8:none,int4-32:int8,int4-32:none,int4-64:int8,int4-32:int4
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts, valid_record  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.loader import load_model  # noqa: E402
from structspec.models.quantize import QuantizationPlan, plan_for, quantize_model  # noqa: E402
from structspec.training.features import TargetFeatureExtractor  # noqa: E402

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.", "List three colors.",
    "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Count from one to ten in words.", "Name a famous scientist and one discovery.",
    "Translate 'good morning' to Spanish.", "Who wrote Romeo and Juliet?",
    "Write a short sentence that uses the word 'lantern'.", "What is 12 times 12?",
    "Describe a cat in five words.", "Tell me a fun fact about octopuses.",
    "Give two synonyms for 'happy'.", "What day comes after Monday?",
    "Write the first line of a fairy tale.", "Name the largest planet in the solar system.",
    "What is the boiling point of water in Celsius?", "Give me three tips for better sleep.",
    "Why is the sky blue? One paragraph.", "Write a limerick about a robot.",
    "What are the primary colors?", "Summarise the plot of Cinderella in two sentences.",
    "How many legs does a spider have?", "Suggest a name for a bakery.",
    "Explain what a prime number is.",
]


def prompts_for(n: int) -> list[str]:
    """``n`` prompts: extraction prompts and chat prompts, alternating."""
    extraction = [p for p, _ in extraction_prompts(n)]
    out: list[str] = []
    for i in range(n):
        out.append(extraction[i // 2] if i % 2 == 0 else CHAT_PROMPTS[(i // 2) % len(CHAT_PROMPTS)])
    return out


def parse_plan(text: str) -> QuantizationPlan:
    """``LAYERS[-GROUP]:LM_HEAD`` -> a plan (``int4-32:int8``)."""
    layers, _, head = text.partition(":")
    kind, _, group = layers.partition("-")
    return QuantizationPlan(layers=kind, int4_group_size=int(group or 32), lm_head=head or "int8")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--plans", default="engine",
                    help="comma-separated LAYERS[-GROUP]:LM_HEAD plans, or 'engine'")
    ap.add_argument("--check-json", type=int, default=0, metavar="N",
                    help="also run N extraction prompts with the JSON Schema per engine mode")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    prompts = prompts_for(args.num_prompts)
    t0 = time.perf_counter()
    with LLM(device="cpu", quantization="none", max_batch_size=16,
             kv_capacity_tokens=16384) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    seqs = [(o.prompt_token_ids, o.token_ids) for o in outs]
    print(f"float32 greedy: {len(seqs)} prompts, {sum(len(t) for _, t in seqs)} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)

    model, config = load_model(resolve_model_path(None), device=torch.device("cpu"),
                               dtype=torch.float32)
    longest = max(len(p) + len(t) for p, t in seqs)
    extractor = TargetFeatureExtractor(model, config, (0,), max_batch_tokens=longest,
                                       device=torch.device("cpu"), dtype=torch.float32)

    def answer_logits(m: torch.nn.Module) -> list[torch.Tensor]:
        extractor.model = m
        rows = []
        for prompt, answer in seqs:
            ids = torch.tensor([prompt + answer[:-1]])
            rows.append(extractor(ids).logits[0, len(prompt) - 1:])  # predicts answer[i]
        return rows

    ref = answer_logits(model)
    # Baseline: the float32 prefill forward against the float32 engine's decode (one row per
    # step); the same weights, so only summation order separates them.
    same = sum(int((r.argmax(-1) == torch.tensor(a[:len(r)])).sum()) for r, (_, a) in zip(ref, seqs, strict=True))
    print(f"float32 teacher-forced vs float32 greedy decode: {100 * same / sum(len(r) for r in ref):.2f}%",
          flush=True)
    plans = ({"int8": plan_for("int8"), "int4": plan_for("int4")} if args.plans == "engine"
             else {s: parse_plan(s) for s in args.plans.split(",")})
    for name, plan in plans.items():
        assert plan is not None
        qmodel = copy.deepcopy(model)
        quantize_model(qmodel, plan)
        got = answer_logits(qmodel)
        agree = total = 0
        diffs: list[float] = []
        for r, g, (_, answer) in zip(ref, got, seqs, strict=True):
            target = torch.tensor(answer[:len(r)])
            agree += int((g.argmax(-1) == target).sum())
            total += len(target)
            diffs.extend((g - r).abs().amax(-1).tolist())
        print(f"plan {name:<14} layers={plan.layers} group={plan.int4_group_size} "
              f"lm_head={plan.lm_head}: argmax agreement {100 * agree / total:6.2f}% "
              f"({agree}/{total} positions), max-abs logit diff mean "
              f"{statistics.mean(diffs):.3f} max {max(diffs):.3f}", flush=True)
        del qmodel

    if args.check_json:
        extraction = [p for p, _ in extraction_prompts(args.check_json)]
        params = SamplingParams(max_tokens=160, temperature=0,
                                grammar=JsonSchemaConstraint(EXTRACTION_SCHEMA))
        for mode in ("none", "int8", "int4"):
            with LLM(device="cpu", quantization=mode, max_batch_size=16,
                     kv_capacity_tokens=8192) as llm:
                outs = llm.generate(extraction, params)
            ok = sum(valid_record(o.text) for o in outs)
            print(f"greedy JSON Schema, quantization={mode}: {ok}/{len(outs)} valid", flush=True)


if __name__ == "__main__":
    main()
