"""Compare the grammar backends (xgrammar, llguidance, auto) on MaskBench schemas.

For every case (schema + valid/invalid instances) and every backend, the engine's own compile
path (``GrammarBackend`` / ``LlgBackend`` / ``SelectingBackend`` with ``strict=True``, one
grammar at a time so that the times are compile latencies, not queue waits) and the engine's
matchers at token level (the instance serialised with the engine's separators ``", "`` and
``": "``, then the stop id). Per backend it prints: schemas compiled, refused (by the keyword
or reason in the error), valid instances accepted, invalid instances accepted (a grammar that
accepts an invalid instance is weaker than its schema), compile time p50 / p99, and for
``auto`` how many schemas each backend served.

Usage::

    python benchmarks/grammar_backends.py [--data tests/data/maskbench] [--max-compile-s 1.0]
        [--backends xgrammar,llguidance,auto] [--timeout-s 10] [--verbose]

Schemas go through the engine's exact rewrites (:mod:`structspec.grammar.schema_rewrite`)
as in serving.
Mask time: per compiled schema, each token's ``fill_bitmask`` along its first valid instance
(up to 64 tokens), p50 / p99 over all of them.

``--max-compile-s`` keeps the cases whose xgrammar compile took at most that long
(``compile_seconds.json``; 0 = every case).

``--ttft``: time to first token of a request whose schema the engine has never seen, per
backend. One engine per backend (``--device``, ``--model``; speculation off, one request at a
time, ``max_tokens=1``, after a warm-up request), then one request per schema over the first
``--num-schemas`` MaskBench schemas (sorted by name) that every listed backend serves:
``RequestOutput.ttft_s`` (arrival to first token: the compile, the prefill, the first
mask), p50 / p90 per backend::

    PYTHONPATH=$PWD python benchmarks/grammar_backends.py --ttft --device cuda --num-schemas 50
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from grammar_weakening import SEPARATORS, STOP_ID, _rule  # noqa: E402

from structspec.config import GrammarConfig  # noqa: E402
from structspec.constraints import JsonSchemaConstraint  # noqa: E402
from structspec.grammar.backend import GrammarBackend  # noqa: E402
from structspec.grammar.bitmask import allocate_bitmask  # noqa: E402
from structspec.grammar.errors import GrammarError  # noqa: E402
from structspec.grammar.llg_backend import LlgBackend  # noqa: E402
from structspec.grammar.llg_matcher import LlgCompiled  # noqa: E402
from structspec.grammar.select_backend import SelectingBackend  # noqa: E402

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def refusal_reason(message: str) -> str:
    """A short reason for a refused schema: the keyword(s) named by either backend's error."""
    if "cannot be enforced exactly" in message:
        return "xgr-strict:" + _rule(message)
    m = _UNIMPLEMENTED.search(message)
    if m:
        return "llg-unimplemented:" + m.group(1).replace('"', "")
    if "oneOf constraints are not supported" in message:
        return "llg:oneOf-overlap"
    if "Unknown format" in message:
        return "llg:format " + message.rsplit(":", 1)[-1].strip()
    if "too complex" in message or "timeout" in message:
        return "too-complex/timeout"
    return "other:" + message.split(":")[-1].strip()[:40]


def make_backend(name: str, tok: Any, config: GrammarConfig) -> Any:
    """A fresh backend of ``name`` (no shared caches between backends)."""
    vocab = len(tok)
    if name == "xgrammar":
        return GrammarBackend(tok, vocab_size=vocab, stop_token_ids=[STOP_ID], config=config)
    llg = LlgBackend(tok, vocab_size=vocab, stop_token_ids=[STOP_ID], config=config)
    if name == "llguidance":
        return SelectingBackend("llguidance", xgrammar=None, llguidance=llg)
    xgr_backend = GrammarBackend(tok, vocab_size=vocab, stop_token_ids=[STOP_ID], config=config)
    return SelectingBackend("auto", xgrammar=xgr_backend, llguidance=llg)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_backend(name: str, tok: Any, cases: list[tuple[str, dict]], timeout_s: float,
                verbose: bool) -> dict[str, Any]:
    config = GrammarConfig(compile_timeout_s=timeout_s, num_compile_threads=1)
    backend = make_backend(name, tok, config)
    backend.wait_ready(120.0)
    compiled_n = 0
    refused: Counter[str] = Counter()
    served: Counter[str] = Counter()
    times: list[float] = []
    mask_times: list[float] = []
    bitmask = allocate_bitmask(1, len(tok), pin=False)
    valid = valid_ok = invalid = invalid_ok = 0
    try:
        for case_name, case in cases:
            t0 = time.perf_counter()
            try:
                compiled = backend.compile(JsonSchemaConstraint(case["schema"]))
            except GrammarError as e:
                refused[refusal_reason(str(e))] += 1
                if verbose:
                    print(f"  {name} refused {case_name}: {str(e)[:120]}")
                continue
            times.append(time.perf_counter() - t0)
            compiled_n += 1
            timed = False
            for t in case["tests"]:
                ids = tok.encode(json.dumps(t["data"], separators=SEPARATORS),
                                 add_special_tokens=False) + [STOP_ID]
                m = backend.create_matcher(compiled)
                ok = m.accept_run(ids) == len(ids) and m.is_terminated()
                if ok and t["valid"] and not timed:  # per-token mask time, one instance
                    timed = True
                    mask_times += mask_seconds(backend.create_matcher(compiled), ids, bitmask)
                if t["valid"]:
                    valid += 1
                    valid_ok += ok
                else:
                    invalid += 1
                    invalid_ok += ok
                    if ok and verbose:
                        print(f"  {name} accepted invalid {case_name}: {t['description'][:60]}")
            served["llguidance" if isinstance(compiled, LlgCompiled) else "xgrammar"] += 1
    finally:
        backend.shutdown()
    return dict(backend=name, cases=len(cases), compiled=compiled_n, refused=refused,
                served=served, valid=valid, valid_ok=valid_ok, invalid=invalid,
                invalid_ok=invalid_ok, p50_ms=1000 * percentile(times, 0.5),
                p99_ms=1000 * percentile(times, 0.99),
                mask_p50_us=1e6 * percentile(mask_times, 0.5),
                mask_p99_us=1e6 * percentile(mask_times, 0.99))


def mask_seconds(matcher: Any, ids: list[int], bitmask: Any, limit: int = 64) -> list[float]:
    """Seconds of each ``fill_bitmask`` along ``ids`` (the first ``limit`` tokens; the stop id
    is not accepted)."""
    out = []
    for tok_id in ids[:-1][:limit]:
        t0 = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        out.append(time.perf_counter() - t0)
        matcher.accept_token(tok_id)
    return out


TTFT_PROMPT = "Write one JSON value that follows the schema."


def run_ttft(args: argparse.Namespace, cases: list[tuple[str, dict]]) -> None:
    """The ``--ttft`` mode (module docstring): prints one line per backend."""
    from structspec import LLM, SamplingParams

    backends = args.backends.split(",")
    # a few more than asked: the common set drops the schemas some backend refuses (~10%)
    candidates = min(len(cases), int(args.num_schemas * 1.3) + 5)
    ttft: dict[str, dict[str, float]] = {}
    for name in backends:
        llm = LLM(args.model, device=args.device, grammar_backend=name,
                  grammar_compile_timeout_s=args.timeout_s, max_batch_size=8)
        try:
            warm = {"type": "object", "properties": {"warm": {"type": "integer"}},
                    "required": ["warm"]}
            llm.generate(TTFT_PROMPT, SamplingParams(max_tokens=4))
            llm.generate(TTFT_PROMPT, SamplingParams(
                max_tokens=4, grammar=JsonSchemaConstraint(warm)))
            got: dict[str, float] = {}
            for case_name, case in cases[: candidates]:
                out = llm.generate(TTFT_PROMPT, SamplingParams(
                    max_tokens=1, grammar=JsonSchemaConstraint(case["schema"])))[0]
                if out.error is None and out.ttft_s is not None:
                    got[case_name] = out.ttft_s
        finally:
            llm.close()
        ttft[name] = got
        print(f"# {name}: {len(got)} of {candidates} schemas served", flush=True)
    common = sorted(set.intersection(*(set(v) for v in ttft.values())))[: args.num_schemas]
    for name in backends:
        values = [ttft[name][c] for c in common]
        print(f"ttft {name:<10} device={args.device} schemas={len(values)} "
              f"served={len(ttft[name])}/{candidates} "
              f"ttft_p50_ms={1000 * percentile(values, 0.5):.1f} "
              f"ttft_p90_ms={1000 * percentile(values, 0.9):.1f}", flush=True)


def engine_tokenizer(model: str | None) -> Any:
    """The tokenizer the engine serves ``model`` with (default: SmolLM2-135M-Instruct)."""
    import transformers

    from structspec.models.default_model import resolve_model_path

    return transformers.AutoTokenizer.from_pretrained(resolve_model_path(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.join(os.path.dirname(__file__), "..")
    ap.add_argument("--data", default=os.path.join(root, "tests", "data", "maskbench"))
    ap.add_argument("--backends", default="xgrammar,llguidance,auto")
    ap.add_argument("--max-compile-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--ttft", action="store_true",
                    help="time to first token with a never-seen schema, per backend")
    ap.add_argument("--num-schemas", type=int, default=50, help="--ttft: schemas per backend")
    ap.add_argument("--device", default="cpu", help="--ttft: the engine's device")
    ap.add_argument("--model", default=None, help="--ttft: model (default SmolLM2-135M)")
    args = ap.parse_args()

    seconds_path = os.path.join(args.data, "compile_seconds.json")
    limits: dict[str, float] = {}
    if args.max_compile_s > 0 and os.path.exists(seconds_path):
        with open(seconds_path) as fh:
            limits = json.load(fh)
    cases = []
    for path in sorted(glob.glob(os.path.join(args.data, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name == "compile_seconds" or (limits and limits.get(name, 1e9) > args.max_compile_s):
            continue
        with open(path) as fh:
            cases.append((name, json.load(fh)))
    if args.ttft:
        run_ttft(args, cases)
        return
    tok = engine_tokenizer(None)
    for name in args.backends.split(","):
        r = run_backend(name, tok, cases, args.timeout_s, args.verbose)
        refused = ", ".join(f"{k}={v}" for k, v in r["refused"].most_common(8))
        print(f"{name:<10} cases={r['cases']} compiled={r['compiled']} "
              f"refused={sum(r['refused'].values())} valid_accepted={r['valid_ok']}/{r['valid']} "
              f"invalid_accepted={r['invalid_ok']}/{r['invalid']} "
              f"compile_p50_ms={r['p50_ms']:.1f} compile_p99_ms={r['p99_ms']:.1f} "
              f"mask_p50_us={r['mask_p50_us']:.0f} mask_p99_us={r['mask_p99_us']:.0f} "
              f"served={dict(r['served'])}")
        print(f"           refused by: {refused}")


if __name__ == "__main__":
    main()
