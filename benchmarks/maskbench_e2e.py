"""Structured generation over MaskBench JSON Schemas, end to end, with validation.

For each schema: a chat prompt asks for a conforming JSON instance; the engine generates under
the schema's grammar (strict mode: schemas using usages xgrammar cannot enforce are rejected up
front with the keyword named). Prints one summary line: stop+valid / stop+invalid / rejected /
truncated (length; ``repeat_stopped`` of them ended by the repetition stop) / other errors,
and the rejection rate. Outputs go to --out as JSONL.

The loop guards of issue 20 are options: ``--frequency-penalty``, ``--presence-penalty``,
``--repetition-penalty`` (every request), ``--stop-on-repeat [MIN_TOKENS]`` (the repetition
stop) and ``--unbounded-numbers`` (the schemas without the default number bounds, i.e. the
behaviour before issue 20).

    python benchmarks/maskbench_e2e.py --limit 120 --max-tokens 1024
    python benchmarks/maskbench_e2e.py --speculative-algorithm ngram --device cuda
    python benchmarks/maskbench_e2e.py --device cuda --max-tokens 512 --repetition-penalty 1.1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import maskbench_eval_cases, schema_prompt  # noqa: E402
from structspec import LLM, FinishReason, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.penalty_params import (  # noqa: E402
    REPETITION_STOP_REASON,
    RepetitionStop,
)


def validate(schema: dict, text: str) -> bool | None:
    """jsonschema verdict, or None where jsonschema is not installed (GPU host)."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls(schema).validate(value)
    except jsonschema.ValidationError:
        return False
    return True


def run(args: argparse.Namespace) -> dict:
    # The one definition of the evaluated cases: EAGLE training leaves exactly these out.
    cases = maskbench_eval_cases(Path(args.data), args.limit,
                                 skip_slow_compile=args.skip_slow_compile)
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              speculative_algorithm=args.speculative_algorithm,
              num_draft_tokens=args.num_draft_tokens, max_batch_size=args.max_batch_size,
              kv_capacity_tokens=args.kv_capacity_tokens,
              grammar_compile_timeout_s=args.compile_timeout,
              grammar_backend=args.grammar_backend, grammar_workers=args.grammar_workers)
    prompts = [schema_prompt(c["schema"]) for c in cases]
    repeat = (None if args.stop_on_repeat is None
              else RepetitionStop(min_tokens=args.stop_on_repeat))
    params = [SamplingParams(max_tokens=args.max_tokens,
                             grammar=JsonSchemaConstraint(
                                 c["schema"], bounded_numbers=not args.unbounded_numbers),
                             temperature=args.temperature, top_p=args.top_p, seed=i,
                             presence_penalty=args.presence_penalty,
                             frequency_penalty=args.frequency_penalty,
                             repetition_penalty=args.repetition_penalty,
                             repetition_stop=repeat)
              for i, c in enumerate(cases)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    with open(args.out, "w") as f:
        for case, out in zip(cases, outs, strict=True):
            if out.finish_reason is FinishReason.STOP:
                ok = validate(case["schema"], out.text)
                kind = {True: "stop_valid", False: "stop_invalid", None: "stop_unchecked"}[ok]
            elif out.finish_reason is FinishReason.LENGTH:
                kind = "truncated"
                if out.stop_reason == REPETITION_STOP_REASON:
                    counts["repeat_stopped"] += 1
            elif out.error and ("cannot be enforced" in out.error
                                or "Failed to compile" in out.error):
                kind = "rejected"
                reasons[out.error.split(":")[0][:60]] += 1
            elif out.error and "compilation exceeded" in out.error:
                kind = "compile_timeout"
            else:
                kind = "error"
            counts[kind] += 1
            f.write(json.dumps({"name": case["_name"], "kind": kind,
                                "stop_reason": out.stop_reason,
                                "text": out.text, "error": out.error,
                                "tokens": len(out.token_ids),
                                "accept_length": out.spec.accept_length}) + "\n")
    n = len(cases)
    ran = n - counts["rejected"] - counts["error"] - counts["compile_timeout"]
    stop = counts["stop_valid"] + counts["stop_invalid"] + counts["stop_unchecked"]
    tokens = sum(len(o.token_ids) for o in outs)
    guards = (f"presence={args.presence_penalty} frequency={args.frequency_penalty} "
              f"repetition={args.repetition_penalty} stop_on_repeat={args.stop_on_repeat} "
              f"bounded_numbers={not args.unbounded_numbers}")
    print(f"maskbench n={n} {guards} max_tokens={args.max_tokens} "
          f"stop_valid={counts['stop_valid']} "
          f"stop_invalid={counts['stop_invalid']} stop_unchecked={counts['stop_unchecked']} "
          f"truncated={counts['truncated']} repeat_stopped={counts['repeat_stopped']} "
          f"truncated_share_of_run={counts['truncated'] / max(ran, 1):.3f} "
          f"rejected={counts['rejected']} "
          f"compile_timeout={counts['compile_timeout']} errors={counts['error']} "
          f"rejection_rate={counts['rejected'] / n:.3f} "
          f"stop_share_of_run={stop / max(ran, 1):.3f} tok/s={tokens / elapsed:.1f} "
          f"time_s={elapsed:.0f} grammar_backend={args.grammar_backend} "
          f"served={dict(Counter(o.grammar_backend for o in outs if o.grammar_backend))}",
          flush=True)
    return {"counts": dict(counts), "n": n, "ran": ran, "stop": stop}


def parser() -> argparse.ArgumentParser:
    """The command line (``run`` takes what it parses; tests start from its defaults)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT / "tests" / "data" / "maskbench"))
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--speculative-algorithm", default="none")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--kv-capacity-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    ap.add_argument("--grammar-backend", default="xgrammar",
                    choices=["xgrammar", "llguidance", "auto"],
                    help="the grammar engine per schema (auto: xgrammar when it enforces the "
                         "schema exactly, else llguidance)")
    ap.add_argument("--skip-slow-compile", action="store_true")
    ap.add_argument("--grammar-workers", type=int, default=None,
                    help="mask worker processes (default: the engine's auto)")
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--stop-on-repeat", type=int, nargs="?", const=RepetitionStop.min_tokens,
                    default=None, metavar="MIN_TOKENS",
                    help="the repetition stop (default MIN_TOKENS: RepetitionStop's)")
    ap.add_argument("--unbounded-numbers", action="store_true",
                    help="no default number bounds (the grammars before issue 20)")
    ap.add_argument("--out", default="maskbench_outputs.jsonl")
    return ap


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
