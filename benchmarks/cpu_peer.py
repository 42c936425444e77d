"""structspec against llama.cpp on CPU, in one run, one line per configuration (issue 22).

Workload: the JSON extraction prompts of benchmarks/workloads.py, chat-formatted, greedy,
``--max-tokens`` new tokens (both engines stop at EOS), same GGUF file (the default model,
SmolLM2-135M-Instruct Q4_1), batch 1: each request alone, wall time from submit to last
token (prefill included, both engines), tok/s = completion tokens / that time, median over
``--num-prompts`` prompts. Rows:

* llama.cpp (llama-cpp-python, ``--threads`` threads): no grammar, and JSON Schema through
  ``response_format={"type": "json_object", "schema": ...}`` (its JSON-schema grammar).
* structspec ``--quantization`` none / int8 / int4: no grammar, and the JSON Schema grammar.
* structspec batch ``--batch`` (JSON Schema): total completion tokens / wall time of
  ``--batch`` requests submitted together (throughput, against llama.cpp's batch 1).

Every JSON-Schema output is checked to parse with the schema's fields and types (``valid``).
llama-cpp-python is a benchmark-only dependency: PyPI has only its source, which builds with
cmake (``pip install llama-cpp-python==0.3.16``, about 10 minutes on 2 cores); without it the
llama.cpp rows are skipped with a line saying so. Machine load (``os.getloadavg``) is printed
before and after: these numbers move with whatever else runs on the cores.

    PYTHONPATH=$PWD python benchmarks/cpu_peer.py --num-prompts 5 --max-tokens 96
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts, valid_record  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.models.default_model import default_gguf_path  # noqa: E402

LLAMA_CPP_INSTALL = ("pip install llama-cpp-python==0.3.16  (source build with cmake, ~10 min "
                     "on 2 cores)")



def line(name: str, grammar: str, batch: int, rates: list[float], valid: str) -> str:
    """One summary line: median tok/s over the prompts (batch 1) or the throughput."""
    rate = statistics.median(rates)
    spread = f"[{min(rates):.1f}..{max(rates):.1f}]" if len(rates) > 1 else ""
    return (f"{name:<24} {grammar:<12} bs={batch:<3} {rate:8.1f} tok/s {spread:<16} "
            f"valid={valid}")


def load_text() -> str:
    """``load 1/5/15 min`` of the machine (other jobs share these cores)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def llama_cpp_rows(prompts: list[str], max_tokens: int, threads: int) -> list[str]:
    """llama.cpp's batch-1 rows (no grammar, JSON Schema), or one line saying it is absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return [f"llama.cpp: llama-cpp-python is not importable, rows skipped; build it with "
                f"`{LLAMA_CPP_INSTALL}`"]
    llm = Llama(model_path=str(default_gguf_path()), n_threads=threads,
                n_threads_batch=threads, n_ctx=2048, seed=0, verbose=False)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    llm.create_chat_completion(msgs[0], max_tokens=8, temperature=0.0)  # warm-up
    rows = []
    for grammar in (False, True):
        rates, ok = [], 0
        for m in msgs:
            kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, top_k=1)
            if grammar:
                kw["response_format"] = {"type": "json_object", "schema": EXTRACTION_SCHEMA}
            t0 = time.perf_counter()
            out = llm.create_chat_completion(m, **kw)
            dt = time.perf_counter() - t0
            rates.append(out["usage"]["completion_tokens"] / dt)
            ok += valid_record(out["choices"][0]["message"]["content"] or "")
        rows.append(line(f"llama.cpp ({threads} threads)", "json_schema" if grammar else "none",
                         1, rates, f"{ok}/{len(msgs)}" if grammar else "-"))
    return rows


def structspec_rows(prompts: list[str], batch_prompts: list[str], max_tokens: int,
                    mode: str, batch: int) -> list[str]:
    """structspec's rows for one ``--quantization`` mode."""
    rows = []
    with LLM(device="cpu", quantization=mode, max_batch_size=max(batch, 1),
             kv_capacity_tokens=8192) as llm:
        name = f"structspec {mode}"
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        schema = JsonSchemaConstraint(EXTRACTION_SCHEMA)
        for grammar in (None, schema):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, grammar=grammar)
            rates, ok = [], 0
            for p in prompts:
                t0 = time.perf_counter()
                out = llm.generate(p, params)[0]
                rates.append(len(out.token_ids) / (time.perf_counter() - t0))
                ok += valid_record(out.text)
            rows.append(line(name, "json_schema" if grammar else "none", 1, rates,
                             f"{ok}/{len(prompts)}" if grammar else "-"))
            print(rows[-1], flush=True)
        if batch > 1:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, grammar=schema)
            t0 = time.perf_counter()
            outs = llm.generate(batch_prompts, [params] * len(batch_prompts))
            dt = time.perf_counter() - t0
            ok = sum(valid_record(o.text) for o in outs)
            rows.append(line(name, "json_schema", batch,
                             [sum(len(o.token_ids) for o in outs) / dt], f"{ok}/{len(outs)}"))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--modes", default="none,int8,int4", help="structspec --quantization modes")
    ap.add_argument("--batch", type=int, default=16, help="structspec throughput batch (0: skip)")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    args = ap.parse_args()
    prompts = [p for p, _ in extraction_prompts(args.num_prompts)]
    batch_prompts = [p for p, _ in extraction_prompts(args.batch, seed=1)] if args.batch > 1 else []
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; {load_text()}", flush=True)
    print(f"workload: {len(prompts)} extraction prompts, greedy, max {args.max_tokens} new "
          f"tokens, GGUF {default_gguf_path().name}", flush=True)
    rows: list[str] = []
    if not args.skip_llama_cpp:
        rows += llama_cpp_rows(prompts, args.max_tokens, args.threads)
        for r in rows:
            print(r, flush=True)
    for mode in args.modes.split(","):
        rows += structspec_rows(prompts, batch_prompts, args.max_tokens, mode, args.batch)
    print(f"\nsummary (structspec torch threads {torch.get_num_threads()}; {load_text()})")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
