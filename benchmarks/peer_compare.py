"""One table: structspec vs Hugging Face ``generate`` on SmolLM2 JSON extraction.

Rows (same prompts, same model weights, greedy):
  hf_generate            HF greedy generate, no grammar, batch 1
  hf_generate+xgrammar   HF generate with xgrammar's HF logits processor (JSON Schema), batch 1
  structspec none        plain decode, no grammar, batch 1
  structspec ngram+json  n-gram speculation + JSON Schema grammar + overlap, batch 1
  structspec ngram+json  the same at batch 64
Every grammar-constrained output is checked to parse as JSON with the schema's fields (the
GPU host has no jsonschema package, so validity = json.loads + required keys + types).

    PYTHONPATH=$PWD python benchmarks/peer_compare.py --device cuda --num-requests 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts, valid_record  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402


def hf_rows(model_dir: str, prompts: list[str], max_tokens: int, device: str) -> list[str]:
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size,
                                              stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(EXTRACTION_SCHEMA),
                                                              any_whitespace=False)
    lines = []
    for grammar in (False, True):
        tokens, valid, t_total = 0, 0, 0.0
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                          add_generation_prompt=True, return_tensors="pt")
            ids = (ids["input_ids"] if not torch.is_tensor(ids) else ids).to(device)
            kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=2, pad_token_id=2)
            if grammar:
                kw["logits_processor"] = [xgr.contrib.hf.LogitsProcessor(compiled)]
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            t_total += time.perf_counter() - t0
            new = out[0, ids.shape[1]:]
            tokens += int(new.numel())
            valid += valid_record(tok.decode(new, skip_special_tokens=True))
        name = "hf_generate+xgrammar" if grammar else "hf_generate"
        lines.append(f"{name:<24} bs=1  tok/s={tokens / t_total:8.1f} "
                     f"valid={valid if grammar else '-'}/{len(prompts)}")
    return lines


def structspec_rows(prompts: list[str], max_tokens: int, device: str, batch64: int,
                    repeats: int = 3) -> list[str]:
    lines = []
    configs = [("structspec none", "none", False, 1), ("structspec ngram+json", "ngram", True, 1),
               ("structspec ngram+json", "ngram", True, 64)]
    engines: dict[str, LLM] = {}
    for name, algo, grammar, bs in configs:
        if algo not in engines:
            engines[algo] = LLM(speculative_algorithm=algo, num_draft_tokens=8, device=device,
                                max_batch_size=64)
        llm = engines[algo]
        sp = SamplingParams(max_tokens=max_tokens,
                            grammar=JsonSchemaConstraint(EXTRACTION_SCHEMA) if grammar else None)
        work = prompts if bs == 1 else (prompts * (-(-batch64 // len(prompts))))[:batch64]
        # Warm-up outside the clock: grammar compile, Triton JIT, and the CUDA graphs of every
        # KV-length bucket and tree size of this batch size (captured lazily they would cost ~0.3 s each
        # inside the timed run: measured 350-525 tok/s for the same plain bs=1 run).
        if llm.engine.runner.device.type == "cuda":
            llm.engine.warmup_cuda_graphs(batch_sizes=[bs])
        llm.generate(work[:bs], sp)
        # The median of several timed runs: one batch-64 run lasts ~0.2 s on an H200, most of
        # it admission and prefill, and single runs of one commit varied by 20% (old/new A/B of
        # the architecture rework, benchmarks/README.md).
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if bs == 1:
                outs = [llm.generate(p, sp)[0] for p in work]
            else:
                outs = llm.generate(work, sp)
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.spec.verify_steps for o in outs)
        acc = sum(o.spec.committed_tokens for o in outs) / max(steps, 1)
        valid = sum(valid_record(o.text) for o in outs) if grammar else "-"
        lines.append(f"{name:<24} bs={bs:<3} tok/s={tokens / dt:8.1f} valid={valid}/{len(outs)} "
                     f"accept_len={acc:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per structspec row; the median is printed")
    args = ap.parse_args()
    prompts = [p for p, _ in extraction_prompts(args.num_requests, seed=0)]
    lines = structspec_rows(prompts, args.max_tokens, args.device, args.batch, args.repeats)
    if not args.skip_hf:
        lines = hf_rows(resolve_model_path(None), prompts, args.max_tokens, args.device) + lines
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# peer_compare device={name} n={len(prompts)} max_tokens={args.max_tokens}")
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    main()
