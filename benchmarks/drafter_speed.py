"""Tokens/s of each drafter at batch 1/8/32/64, with and without a JSON Schema, on held-out
ShareGPT prompts and on JSON extraction prompts (issue 18; one summary line per configuration).

Workloads (prompts the EAGLE head never trained on):
  sharegpt    held-out ShareGPT first turns (the fixed 5% split of train-eagle); with a grammar
              the answer is a JSON object ``{"answer": "..."}`` (:data:`ANSWER_SCHEMA`), so the
              model still writes its own text, inside a JSON string
  extraction  JSON extraction prompts (``benchmarks/workloads.py``, seed 0); with a grammar
              under their schema (:data:`~benchmarks.workloads.EXTRACTION_SCHEMA`)
Drafters: ``none``, ``ngram``, ``eagle`` (``--draft-model``, default: the head shipped for the
default model), ``draft_model`` (``--draft-model-path``, default: the target as its own draft,
SmolLM2 having no smaller sibling offline), and any other registered name.

Each engine first captures every CUDA graph of the batch buckets up to the largest batch and
the KV lengths the prompts reach (each tree size the adaptive sizer may pick). Each
configuration runs its prompts twice: an untimed pass (grammar compile, Triton JIT), then the
timed pass (greedy, prefix cache
off so both passes prefill the same). Batch 1 runs its prompts one at a time; batch ``B`` sends
``B`` prompts at once. tok/s = generated tokens / wall time of the timed pass (prefill
included); ``vs_none`` = tok/s over ``none``'s in the same (workload, grammar, batch).

    PYTHONPATH=$PWD python benchmarks/drafter_speed.py --device cuda --compact

``--compact`` (the whole grid of the four default drafters in under 4 minutes on an H200, an
estimate: 4 engines x 16 configurations, each ~2-3 s with its warm-up pass): 48 new tokens, 3
prompts at batch 1; without it 128 new tokens, 8 prompts at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.speculative.registry import drafter_names  # noqa: E402
from structspec.training.prompts import sharegpt_held_out_prompts  # noqa: E402

#: the JSON Schema of the ShareGPT prompts' constrained runs: the model's own answer, as a string
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
                 "required": ["answer"], "additionalProperties": False}

#: the longest prompt kept (tokens): the few very long ShareGPT turns would be all prefill
MAX_PROMPT_TOKENS = 768


def workload_prompts(name: str, n: int, tokenizer: object) -> tuple[list[str], dict]:
    """``(prompts, schema)`` of one workload: ``n`` prompts (ShareGPT: the first ``n`` held-out
    turns of at most :data:`MAX_PROMPT_TOKENS` tokens, in file order).

    Raises:
        ValueError: an unknown workload name, or fewer than ``n`` prompts.
    """
    if name == "extraction":
        prompts = [p for p, _ in extraction_prompts(n, seed=0)]
        schema = EXTRACTION_SCHEMA
    elif name == "sharegpt":
        encode = tokenizer.encode  # type: ignore[attr-defined]
        prompts = []
        for p in sharegpt_held_out_prompts():
            if len(encode(p)) <= MAX_PROMPT_TOKENS:
                prompts.append(p)
            if len(prompts) == n:
                break
        schema = ANSWER_SCHEMA
    else:
        raise ValueError(f"workload {name!r}: expected sharegpt or extraction")
    if len(prompts) < n:
        raise ValueError(f"workload {name}: {len(prompts)} prompts, {n} needed")
    return prompts, schema


def timed_run(llm: LLM, prompts: list[str], params: SamplingParams, bs: int,
              ) -> tuple[float, list]:
    """Seconds of one pass and its outputs: one prompt at a time at ``bs == 1``, else all
    ``len(prompts) == bs`` prompts at once."""
    cuda = llm.engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if bs == 1:
        outs = [llm.generate(p, params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft-model", default=None,
                    help="EAGLE head of eagle (default: the shipped one)")
    ap.add_argument("--draft-model-path", default=None,
                    help="draft model of draft_model (default: the target itself)")
    ap.add_argument("--algorithms", nargs="+", default=["none", "ngram", "eagle", "draft_model"],
                    choices=drafter_names())
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "extraction"],
                    choices=["sharegpt", "extraction"])
    ap.add_argument("--grammar", nargs="+", default=["none", "json_schema"],
                    choices=["none", "json_schema"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--speculative-adaptive", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--compact", action="store_true",
                    help="48 new tokens, 3 prompts at batch 1 (the grid in < 4 min on an H200)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 128 (compact 48)")
    ap.add_argument("--batch1-prompts", type=int, default=None,
                    help="prompts run one at a time at batch 1 (default: 8, compact 3)")
    args = ap.parse_args()
    max_tokens = args.max_tokens or (48 if args.compact else 128)
    n1 = args.batch1_prompts or (3 if args.compact else 8)
    model = resolve_model_path(args.model)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# drafter_speed device={name} max_tokens={max_tokens} batch1_prompts={n1} "
          f"N={args.num_draft_tokens} depth={args.depth} topk={args.topk} "
          f"adaptive={args.speculative_adaptive}", flush=True)
    if "sharegpt" in args.workloads:
        # before any engine is built: a machine without the data used to find out only after
        # each engine's graph captures (about a minute per algorithm)
        try:
            sharegpt_held_out_prompts()
        except FileNotFoundError as e:
            raise SystemExit(f"drafter_speed: --workloads sharegpt: {e}") from None
    base: dict[tuple[str, str, int], float] = {}
    t_start = time.perf_counter()
    for algo in args.algorithms:
        draft = {"eagle": args.draft_model,
                 "draft_model": args.draft_model_path or model}.get(algo)
        # the target as named (None: the default model, whose shipped head eagle drafts
        # with when --draft-model is not given)
        llm = LLM(args.model, device=args.device, speculative_algorithm=algo, draft_model=draft,
                  num_draft_tokens=args.num_draft_tokens, speculative_depth=args.depth,
                  speculative_topk=args.topk, speculative_adaptive=args.speculative_adaptive,
                  max_batch_size=max(args.batch), enable_prefix_caching=False)
        # Every graph a run can reach, before any timing: a batch shrinks bucket by bucket as
        # its requests finish, and the adaptive sizer picks other tree sizes from run to run,
        # so the untimed pass alone does not capture everything the timed pass replays.
        t_graphs = time.perf_counter()
        n_graphs = llm.engine.warmup_cuda_graphs(
            kv_lens=[256 * 2 ** i for i in range(8) if 256 * 2 ** i < MAX_PROMPT_TOKENS * 2
                     + max_tokens] or None)
        if n_graphs:
            print(f"# {algo}: {n_graphs} CUDA graphs captured in "
                  f"{time.perf_counter() - t_graphs:.1f} s", flush=True)
        for work in args.workloads:
            prompts, schema = workload_prompts(work, max(max(args.batch), n1),
                                               llm.engine.tokenizer)
            for grammar in args.grammar:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=0.0,
                    grammar=JsonSchemaConstraint(schema) if grammar == "json_schema" else None)
                for bs in args.batch:
                    batch = prompts[: n1 if bs == 1 else bs]
                    timed_run(llm, batch, params, bs)  # warm-up pass, untimed
                    dt, outs = timed_run(llm, batch, params, bs)
                    tokens = sum(len(o.token_ids) for o in outs)
                    steps = sum(o.spec.verify_steps for o in outs)
                    committed = sum(o.spec.committed_tokens for o in outs)
                    errors = sum(o.error is not None for o in outs)
                    rate = tokens / dt
                    key = (work, grammar, bs)
                    if algo == "none":
                        base[key] = rate
                    vs = f"{rate / base[key]:.2f}" if key in base else "-"
                    print(f"drafter_speed algo={algo} workload={work} grammar={grammar} "
                          f"bs={bs} tok/s={rate:.1f} vs_none={vs} "
                          f"accept_len={committed / max(steps, 1):.2f} tokens={tokens} "
                          f"requests={len(outs)} errors={errors} s={dt:.2f}", flush=True)
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"# drafter_speed done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
