"""Our Matcher (built through GrammarBackend) accepts exactly what a bare xgrammar matcher
accepts, on the MaskBench valid instances tokenized by the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend, GrammarError, find_unenforceable
from structspec.grammar.compile_spec import schema_text

from .conftest import STOP_ID, fast_compile_names

SEP = (", ", ": ")  # any_whitespace=False: xgrammar's default separators


def _run(backend: GrammarBackend, hf_tokenizer: Any,
         cases: list[tuple[str, dict[str, Any]]]) -> tuple[int, int]:
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, stop_token_ids=[STOP_ID])
    bare_compiler = xgr.GrammarCompiler(info, max_threads=2)
    # Ours: strict where the check allows it (the engine's path), else best effort; both
    # compile with strict_mode=True, any_whitespace=False.
    ours = [(n, c, backend.submit(JsonSchemaConstraint(c["schema"],
                                                 strict=not find_unenforceable(c["schema"]))))
            for n, c in cases]

    def bare(case: dict[str, Any]) -> xgr.CompiledGrammar | None:
        # the text the engine compiles: the schema's exact rewrite, or the schema as sent
        # when xgrammar does not take the rewrite's forms (compile_spec._compile_or_unrewritten)
        spec = JsonSchemaConstraint(case["schema"])
        for text in dict.fromkeys([schema_text(spec), spec.canonical_text()]):
            try:
                return bare_compiler.compile_json_schema(text, any_whitespace=False,
                                                         strict_mode=True)
            except Exception:  # noqa: BLE001 - compile failures are compared below
                continue
        return None

    with ThreadPoolExecutor(2) as ex:
        bare_compiled = list(ex.map(bare, [c for _, c in cases]))
    total = accepted = 0
    for (name, case, fut), bare_cg in zip(ours, bare_compiled, strict=True):
        try:
            cg = fut.result(timeout=300)
        except GrammarError:
            assert bare_cg is None, name
            continue
        assert bare_cg is not None, name
        for t in case["tests"]:
            if not t["valid"]:
                continue
            ids = hf_tokenizer.encode(json.dumps(t["data"], separators=SEP),
                                      add_special_tokens=False) + [STOP_ID]
            m = backend.create_matcher(cg)
            ok_ours = m.accept_run(ids) == len(ids) and m.is_terminated()
            assert m.num_accepted == (len(ids) if ok_ours else m.num_accepted)
            b = xgr.GrammarMatcher(bare_cg, override_stop_tokens=[STOP_ID])
            ok_bare = all(b.accept_token(i) for i in ids) and b.is_terminated()
            assert ok_ours == ok_bare, (name, t["description"])
            total += 1
            accepted += ok_ours
    return total, accepted


def test_valid_instances_same_as_bare_xgrammar(
        backend: GrammarBackend, hf_tokenizer: Any,
        maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    t0 = time.perf_counter()
    fast = fast_compile_names()
    # every other fast-compiling case (the suite's time budget; all of them: the slow test)
    total, accepted = _run(backend, hf_tokenizer,
                           [(n, c) for n, c in maskbench if n in fast][::2])
    print(f"\nwiring: {accepted}/{total} valid instances accepted "
          f"({accepted / total:.1%}) by ours and bare xgrammar alike, "
          f"{time.perf_counter() - t0:.1f}s")
    assert total > 170 and 0.75 < accepted / total < 0.95


@pytest.mark.slow
def test_valid_instances_same_as_bare_xgrammar_all(
        backend: GrammarBackend, hf_tokenizer: Any,
        maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    total, accepted = _run(backend, hf_tokenizer, maskbench)
    print(f"\nwiring (all): {accepted}/{total} ({accepted / total:.1%})")
