"""What one tree bitmask costs on this CPU, per backend: xgrammar vs llguidance, for the
``records`` workload of ``grammar_overlap.py`` (its JSON schema, SmolLM2's tokenizer), and the
llguidance levers that could make it cheaper. No GPU needed.

Every request holds a matcher advanced along its own valid output (``{"items": [`` then copies
of its record, as the records workload's requests write them), started at a spread of
positions so the states cover keys, strings, numbers and separators. One summary line per
configuration:

- ``mask_us``: one mask at each fresh state along the output (fill, then accept the true next
  token; each state is masked once, as in the engine), mean / p50 / p99 in us. llguidance:
  ``LLMatcher.unsafe_compute_mask_ptr``; xgrammar: ``fill_next_token_bitmask``.
- ``walk_ms``: one verify step's tree walk per request (``traverse_draft_tree`` into the
  request's ``[N, W]`` rows) on an 8-node tree: ``--tree chain`` (default; root + the 7 true
  next tokens, the n-gram drafter's tree on this workload) or ``branch`` (a chain with one
  wrong branch, as ``mask_build.py``); ``node_us`` per filled row; then ``advance_us``:
  ``accept_run`` of the ``N - 1`` committed tokens, which moves to the next step's states.
- ``dup_rows``: of the rows one batch step fills, the share equal to another row of the same
  step: the most a cache of identical states could save.
- ``pool`` (``--pool-workers``): the same steps through the engine's mask worker processes
  (``build_grammar_vocab_mask_pooled``); the busiest worker's own time per step
  (``pool_worker_max_ms`` of ``grammar_overlap.py``) and per request it serves.
- ``par`` (``--par-threads``): the chains of every request, filled at the same states by the
  recursive Python walk, by ``traverse_draft_tree`` (a chain in one llguidance call per
  request) and by one ``LLExecutor`` call for the whole batch per thread count.

Levers (``--variants``, each ``slices,ws,strict|lenient``, one llguidance line each):
``slices`` (``LLTokenizer`` token-slice optimisation: ``general``, llguidance's default and
what ``LlgTokenizerSource.build`` gets, equal to ``json_slices()`` in llguidance 1.9;
``none`` turns it off), ``ws`` (``compact`` separators, the engine's default, or
``flexible`` whitespace), ``lenient`` (llguidance's ignore-unknown-keywords option).

    PYTHONPATH=$PWD python benchmarks/tree_mask_cost.py --pool-workers 1 2
    PYTHONPATH=$PWD python benchmarks/tree_mask_cost.py --requests 64 --pool-workers 8 \
        --variants general,compact,strict --par-threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA  # noqa: E402
from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec.constraints import JsonSchemaConstraint  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.grammar.backend import GrammarBackend  # noqa: E402
from structspec.grammar.llg_backend import LlgBackend  # noqa: E402
from structspec.grammar.llg_compile import json_options  # noqa: E402
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher  # noqa: E402
from structspec.grammar.llg_tokenizer import LlgTokenizerSource  # noqa: E402
from structspec.grammar.matcher import Matcher  # noqa: E402
from structspec.grammar.tree_mask import (  # noqa: E402
    GrammarTree,
    build_grammar_vocab_mask_pooled,
)
from structspec.grammar.worker_pool import MaskWorkerPool, PoolRequest  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.tokenizer import Tokenizer  # noqa: E402

VOCAB = 49152
"""SmolLM2-135M's logits width."""

AnyM = Matcher | LlgMatcher


def record_outputs(tok: Tokenizer, num: int, copies: int) -> list[list[int]]:
    """``num`` token-id outputs of the records workload, each ``{"items": [`` and ``copies``
    copies of its own record (compact JSON, as the grammar's separators write it)."""
    outs = []
    for _, rec in extraction_prompts(num, seed=3):
        item = {"name": rec["name"], "city": rec["city"], "age": rec["age"]}
        text = json.dumps({"items": [item] * copies}, ensure_ascii=False)[:-2]  # array open
        outs.append(tok.hf.encode(text, add_special_tokens=False))
    return outs


def stats_us(seconds: Sequence[float]) -> str:
    """``mean/p50/p99`` of ``seconds`` in microseconds."""
    a = np.asarray(seconds) * 1e6
    return f"{a.mean():.2f}/{np.percentile(a, 50):.2f}/{np.percentile(a, 99):.1f}"


def time_masks(make: Callable[[], AnyM], outputs: list[list[int]], skip: int,
               length: int) -> list[float]:
    """Seconds of each mask at the fresh states ``skip..skip+length`` of every output (fill,
    then accept the true next token; the matcher starts at the grammar's start)."""
    width = (VOCAB + 31) // 32
    row = torch.full((1, width), -1, dtype=torch.int32)
    ptr, nbytes = row.data_ptr(), width * 4
    out: list[float] = []
    for ids in outputs:
        m = make()
        assert m.accept_run(ids[:skip]) == skip
        if isinstance(m, LlgMatcher):
            llg = m._llg  # noqa: SLF001 - the raw call, as the walk makes it
            for t in ids[skip: skip + length]:
                t0 = time.perf_counter()
                llg.unsafe_compute_mask_ptr(ptr, nbytes)
                out.append(time.perf_counter() - t0)
                assert llg.consume_token(t)
        else:
            xm = m.xgr_matcher
            for t in ids[skip: skip + length]:
                t0 = time.perf_counter()
                xm.fill_next_token_bitmask(row, 0)
                out.append(time.perf_counter() - t0)
                assert xm.accept_token(t)
    return out


def step_trees(outputs: list[list[int]], starts: list[int], n: int, shape: str) -> VerifyTree:
    """One step's ``[bs, n]`` trees: node 0 the last committed token, then ``chain``: the
    ``n - 1`` true next tokens (the n-gram drafter's tree on this workload), or ``branch``: a
    chain of ``n - 2`` and a wrong branch (a later token) under node 1 (``mask_build.py``)."""
    toks, pars = [], []
    for ids, pos in zip(outputs, starts, strict=True):
        if shape == "chain":
            toks.append(ids[pos - 1: pos - 1 + n])
            pars.append(list(range(-1, n - 1)))
        else:
            toks.append(ids[pos - 1: pos - 1 + n - 1] + [ids[pos + 3]])
            pars.append(list(range(-1, n - 2)) + [1])
    return VerifyTree.from_parents(torch.tensor(toks, dtype=torch.int64),
                                   torch.tensor(pars, dtype=torch.int64))


def run_walks(make: Callable[[], AnyM], outputs: list[list[int]], steps: int, n: int,
              skip: int, shape: str) -> dict[str, Any]:
    """``steps`` verify steps of every request: the tree walk, then the advance over the
    ``n - 1`` committed tokens. Returns per-walk and per-advance seconds, rows filled and the
    duplicate-row share per step."""
    bs = len(outputs)
    matchers = [make() for _ in range(bs)]
    starts = [skip + (b * 7) % 40 for b in range(bs)]
    for m, ids, s in zip(matchers, outputs, starts, strict=True):
        assert m.accept_run(ids[:s]) == s
    width = (VOCAB + 31) // 32
    rows = torch.full((bs, n, width), -1, dtype=torch.int32)
    walk_s, adv_s, filled, dup, total = [], [], 0, 0, 0
    for _ in range(steps):
        vt = step_trees(outputs, starts, n, shape)
        rows.fill_(-1)
        for b, m in enumerate(matchers):
            t0 = time.perf_counter()
            ok = m.traverse_draft_tree(vt.next_token[b], vt.next_sibling[b],
                                       vt.draft_tokens[b], rows[b], 1.0)
            walk_s.append(time.perf_counter() - t0)
            assert ok
        # rows the walk filled: the chain (n - 1 nodes; its last node's row too) and the wrong
        # branch only when its parent's row allows it
        seen: set[bytes] = set()
        for b in range(bs):
            for node in range(n):
                r = rows[b, node].numpy()
                if (r == -1).all():
                    continue
                filled += 1
                total += 1
                h = hashlib.blake2b(r.tobytes(), digest_size=16).digest()
                dup += h in seen
                seen.add(h)
        for b, m in enumerate(matchers):
            run = outputs[b][starts[b]: starts[b] + n - 1]
            t0 = time.perf_counter()
            assert m.accept_run(run) == len(run)
            adv_s.append(time.perf_counter() - t0)
            starts[b] += len(run)
    return {"walk": walk_s, "advance": adv_s, "rows": filled / (steps * bs),
            "dup": dup / max(total, 1)}


def run_par(make: Callable[[], LlgMatcher], outputs: list[list[int]], steps: int, n: int,
            skip: int, threads: Sequence[int]) -> None:
    """The ``n``-node chains (root + ``n - 1`` true next tokens) of every request per step,
    filled several ways at the same states, in turn (each leaves the matchers as they were):
    ``python_walk`` (``LlgMatcher.traverse_draft_tree``'s recursive Python walk, its chain
    path turned off), ``traverse_draft_tree`` (the engine's: a chain in one llguidance call
    per request), and per thread count one ``LLExecutor`` call for the whole batch. Prints
    one line per method, and whether its rows equal the Python walk's."""
    bs = len(outputs)
    width = (VOCAB + 31) // 32
    ms = [make() for _ in range(bs)]
    st = [skip + (b * 7) % 40 for b in range(bs)]
    for m, ids, s in zip(ms, outputs, st, strict=True):
        assert m.accept_run(ids[:s]) == s
    nt = torch.tensor(list(range(1, n)) + [-1], dtype=torch.int64)
    ns = torch.full((n,), -1, dtype=torch.int64)
    executors = {th: llguidance.LLExecutor(th) for th in threads}
    methods = ["python_walk", "traverse_draft_tree", *[f"llexecutor_batch threads={th}"
                                                       for th in threads]]
    spent = dict.fromkeys(methods, 0.0)
    same = dict.fromkeys(methods, True)
    rows = {k: torch.full((bs * n, width), -1, dtype=torch.int32) for k in methods}
    chain_path = LlgMatcher._walk_chain  # noqa: SLF001 - turned off for python_walk

    def python_walk(self: LlgMatcher, *args: Any) -> None:
        return None

    for step in range(steps):
        dts = [torch.tensor(outputs[b][st[b] - 1: st[b] - 1 + n], dtype=torch.int64)
               for b in range(bs)]
        for k in methods[step % len(methods):] + methods[: step % len(methods)]:
            out = rows[k]
            if k.startswith("llexecutor"):
                jobs = [(m._llg, b * n, outputs[b][st[b]: st[b] + n - 1])  # noqa: SLF001
                        for b, m in enumerate(ms)]
                ex = executors[int(k.split("=")[1])]
                t0 = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(ex, jobs, out)
                spent[k] += time.perf_counter() - t0
                continue
            LlgMatcher._walk_chain = (  # type: ignore[method-assign]
                python_walk if k == "python_walk" else chain_path)
            try:
                for b, m in enumerate(ms):
                    t0 = time.perf_counter()
                    assert m.traverse_draft_tree(nt, ns, dts[b], out[b * n:(b + 1) * n], 1.0)
                    spent[k] += time.perf_counter() - t0
            finally:
                LlgMatcher._walk_chain = chain_path  # type: ignore[method-assign]
        for k in methods:
            same[k] &= bool(torch.equal(rows[k], rows["python_walk"]))
        for b, m in enumerate(ms):
            m.accept_run(outputs[b][st[b]: st[b] + n - 1])
            st[b] += n - 1
    for k in methods:
        print(f"tree_mask_cost par method={k} requests={bs} chain={n} "
              f"ms_per_step={spent[k] / steps * 1e3:.3f} "
              f"us_per_request={spent[k] / (steps * bs) * 1e6:.2f} "
              f"same_rows={same[k]}", flush=True)


def run_pool(backend: Any, compiled: Any, outputs: list[list[int]], steps: int, n: int,
              skip: int, workers: int, stop_ids: list[int], name: str) -> None:
    """The same steps through the engine's mask worker processes
    (:func:`build_grammar_vocab_mask_pooled`: mirrors advance over the new ids, then walk;
    the host matchers advance meanwhile, as the scheduler's barrier). Prints the busiest
    worker's own time per step (``pool_worker_max_ms`` of ``grammar_overlap.py``) and that
    time per request it serves."""
    bs = len(outputs)
    llg = isinstance(compiled, LlgCompiled)
    pool = MaskWorkerPool(None if llg else backend.tokenizer_info, num_workers=workers,
                          vocab_size=VOCAB, max_rows=bs * n, stop_token_ids=stop_ids,
                          llguidance_tokenizer=backend.tokenizer_source if llg else None)
    try:
        starts = [skip + (b * 7) % 40 for b in range(bs)]
        matchers = [backend.create_matcher(compiled) for _ in range(bs)]
        for m, ids, s in zip(matchers, outputs, starts, strict=True):
            assert m.accept_run(ids[:s]) == s
        reqs = [PoolRequest(f"r{b}", compiled, outputs[b][: starts[b]]) for b in range(bs)]
        deadline = time.perf_counter() + 120
        while not all(pool.ready(r.key, compiled) for r in reqs):
            pool.collect_shipped()
            if time.perf_counter() > deadline:
                raise RuntimeError("grammars not loaded by the workers after 120 s")
            time.sleep(0.01)
        busy_max, busy_mean = [], []
        for step in range(steps + 2):  # 2 warm-up steps (the first walks of new mirrors)
            vt = step_trees(outputs, starts, n, "chain")
            tree = GrammarTree.from_host(vt.next_token, vt.next_sibling, vt.draft_tokens,
                                         vt.parents)
            mask = build_grammar_vocab_mask_pooled(pool, reqs, matchers, tree, device="cpu")
            assert mask is not None and mask.mirror is not None
            if step >= 2:
                busy_max.append(max(mask.mirror.worker_busy_ms))
                busy_mean.append(float(np.mean(mask.mirror.worker_busy_ms)))
            for b, m in enumerate(matchers):  # the committed run: next step's new ids
                run = outputs[b][starts[b]: starts[b] + n]
                assert m.accept_run(run) == len(run)
                starts[b] += len(run)
                reqs[b].output_ids = outputs[b][: starts[b]]
        per_req = float(np.mean(busy_mean)) / (bs / workers)
        print(f"tree_mask_cost pool {name} workers={workers} requests={bs} nodes={n} "
              f"worker_max_ms={np.mean(busy_max):.3f} worker_mean_ms={np.mean(busy_mean):.3f} "
              f"us_per_request={per_req * 1e3:.1f} cores={os.cpu_count()}", flush=True)
    finally:
        pool.close()


def llg_maker(source: LlgTokenizerSource, *, slices: str, ws: str, lenient: bool,
              stop_ids: list[int]) -> Callable[[], LlgMatcher]:
    """A factory of fresh llguidance matchers for one variant (its own tokenizer and
    compile, as a mask worker process has)."""
    sl = None if slices == "general" else []
    tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=source.vocab_size,
                                       eos_token=list(source.eos_token_ids), slices=sl)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(LONG_SCHEMA),
        overrides=json_options(any_whitespace=ws == "flexible",  # type: ignore[arg-type]
                               lenient=lenient))
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not template.is_error(), template.get_error()
    compiled = LlgCompiled(template=template, vocab_size=VOCAB, kind="json_schema",
                           grammar=grammar)
    return lambda: LlgMatcher(compiled, stop_token_ids=stop_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests (distinct records)")
    ap.add_argument("--steps", type=int, default=20, help="verify steps per request")
    ap.add_argument("--num-nodes", type=int, default=8)
    ap.add_argument("--skip", type=int, default=20,
                    help="tokens accepted before the first measured state")
    ap.add_argument("--mask-states", type=int, default=150, help="masked states per request")
    ap.add_argument("--variants", nargs="+",
                    default=["general,compact,strict", "none,compact,strict",
                             "general,flexible,strict", "general,compact,lenient"],
                    help="llguidance variants: slices,ws,lenient")
    ap.add_argument("--tree", choices=["chain", "branch"], default="chain",
                    help="tree shape of the walks (step_trees)")
    ap.add_argument("--pool-workers", type=int, nargs="*", default=[],
                    help="also time the mask worker processes (both backends) with these "
                         "process counts")
    ap.add_argument("--par-threads", type=int, nargs="*", default=[1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a mask worker process (idle intra-op threads spin)
    tok = Tokenizer(resolve_model_path(None))
    stop_ids = list(tok.eos_token_ids)
    copies = 2 + (args.skip + 40 + args.steps * args.num_nodes + args.mask_states) // 20
    outputs = record_outputs(tok, args.requests, copies)
    common = (f"tree={args.tree} requests={args.requests} steps={args.steps} nodes={args.num_nodes} "
              f"cores={os.cpu_count()}")

    xb = GrammarBackend(tok.hf, vocab_size=VOCAB, stop_token_ids=stop_ids)
    xc = xb.compile(JsonSchemaConstraint(LONG_SCHEMA))
    configs: list[tuple[str, Callable[[], AnyM]]] = [
        ("backend=xgrammar", lambda: xb.create_matcher(xc))]
    source = LlgTokenizerSource.from_hf(tok.hf, vocab_size=VOCAB, stop_token_ids=stop_ids)
    for v in args.variants:
        slices, ws, strict = v.split(",")
        configs.append((f"backend=llguidance slices={slices} ws={ws} lenient="
                        f"{strict == 'lenient'}",
                        llg_maker(source, slices=slices, ws=ws, lenient=strict == "lenient",
                                  stop_ids=stop_ids)))
    for name, make in configs:
        time_masks(make, outputs[:2], args.skip, 50)  # warm the lexer caches
        mask_s = time_masks(make, outputs, args.skip, args.mask_states)
        w = run_walks(make, outputs, args.steps, args.num_nodes, args.skip, args.tree)
        walk = np.asarray(w["walk"])
        print(f"tree_mask_cost {name} mask_us={stats_us(mask_s)} "
              f"walk_ms={walk.mean() * 1e3:.4f} node_us={walk.mean() / w['rows'] * 1e6:.2f} "
              f"rows_per_walk={w['rows']:.2f} advance_us={stats_us(w['advance'])} "
              f"dup_rows={w['dup']:.3f} {common}", flush=True)
    lb = LlgBackend(tok.hf, vocab_size=VOCAB, stop_token_ids=stop_ids) \
        if args.pool_workers else None
    for workers in args.pool_workers:
        run_pool(xb, xc, outputs, args.steps, args.num_nodes, args.skip, workers, stop_ids,
                 "backend=xgrammar")
        run_pool(lb, lb.compile(JsonSchemaConstraint(LONG_SCHEMA)), outputs, args.steps,
                 args.num_nodes, args.skip, workers, stop_ids, "backend=llguidance")
    if args.par_threads:
        run_par(configs[1][1], outputs, args.steps, args.num_nodes,  # type: ignore[arg-type]
                args.skip, args.par_threads)


if __name__ == "__main__":
    main()
