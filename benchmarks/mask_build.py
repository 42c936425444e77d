"""Host cost of the tree bitmask build per verify step, by batch size and thread count.

Every request holds a JSON-Schema matcher advanced into a long array of objects (positions
spread over keys, strings and numbers), and an 8-node draft tree (a chain of the true next
tokens with one wrong branch). One summary line per (tokenizer, batch, threads): mean ms of
``build_grammar_vocab_mask`` (tree walk + settle + pinned copy source) and of the barrier-like
advance of 7 tokens per request. No GPU needed; run it on the GPU host to size the thread
pool for its cores.

    PYTHONPATH=$PWD python benchmarks/mask_build.py --batch 1 8 32 64 --threads 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA  # noqa: E402
from structspec.constraints import JsonSchemaConstraint  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.grammar.backend import GrammarBackend  # noqa: E402
from structspec.grammar.tree_mask import (  # noqa: E402
    GrammarTree,
    build_grammar_vocab_mask,
    build_grammar_vocab_mask_pooled,
)
from structspec.grammar.worker_pool import MaskWorkerPool, PoolRequest  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.tokenizer import Tokenizer  # noqa: E402

LLAMA3_DIR = Path(__file__).resolve().parent / "assets" / "llama3-8b-shape"


def sample_text(num_items: int) -> str:
    return '{"items": [' + ", ".join(
        f'{{"name": "Person {i} of the list", "city": "City number {i * 7 % 13}", '
        f'"age": {20 + i % 50}}}' for i in range(num_items))


def run_tokenizer(name: str, model_dir: str, vocab_size: int, args: argparse.Namespace) -> None:
    tok = Tokenizer(model_dir)
    backend = GrammarBackend(tok.hf, vocab_size=vocab_size,
                             stop_token_ids=list(tok.eos_token_ids))
    compiled = backend.compile(JsonSchemaConstraint(LONG_SCHEMA))
    ids = tok.hf.encode(sample_text(200), add_special_tokens=False)
    n = args.num_nodes
    for bs in args.batch:
        matchers, trees = [], []
        for b in range(bs):
            pos = 40 + (b * 37) % (len(ids) - 80)  # spread states over keys/strings/numbers
            m = backend.create_matcher(compiled)
            assert m.accept_run(ids[:pos]) == pos
            matchers.append(m)
            chain = ids[pos - 1: pos - 1 + n - 1] + [ids[pos + 3]]  # chain + a wrong branch
            parents = list(range(-1, n - 2)) + [1]
            trees.append((chain, parents))
        toks = torch.tensor([t for t, _ in trees], dtype=torch.int64)
        pars = torch.tensor([p for _, p in trees], dtype=torch.int64)
        vt = VerifyTree.from_parents(toks, pars)
        for threads in args.threads:
            ex = ThreadPoolExecutor(threads) if threads > 1 else None

            def build(ex: ThreadPoolExecutor | None = ex, threads: int = threads,
                      vt: VerifyTree = vt, matchers: list = matchers) -> None:
                gt = GrammarTree.from_host(vt.next_token, vt.next_sibling, vt.draft_tokens,
                                           vt.parents)
                build_grammar_vocab_mask(matchers, gt, vocab_size=vocab_size, device="cpu",
                                         executor=ex, num_workers=threads)

            build()
            t0 = time.perf_counter()
            for _ in range(args.reps):
                build()
            mask_ms = (time.perf_counter() - t0) / args.reps * 1e3
            t0 = time.perf_counter()
            for _ in range(args.reps):
                for b, m in enumerate(matchers):
                    pos = 40 + (b * 37) % (len(ids) - 80)
                    m.accept_run(ids[pos: pos + 7])
                    m.rollback(7)
            adv_ms = (time.perf_counter() - t0) / args.reps * 1e3
            print(f"mask_build tokenizer={name} vocab={vocab_size} batch={bs} nodes={n} "
                  f"threads={threads} build_ms={mask_ms:.3f} advance7_ms={adv_ms:.3f} "
                  f"cores={os.cpu_count()}", flush=True)
            if ex is not None:
                ex.shutdown()
        for workers in args.workers:
            pool = MaskWorkerPool(backend.tokenizer_info, num_workers=workers,
                                  vocab_size=vocab_size, max_rows=max(args.batch) * n,
                                  stop_token_ids=list(tok.eos_token_ids))
            reqs = [PoolRequest(f"r{b}", compiled, []) for b in range(bs)]

            def build_pooled(pool: MaskWorkerPool = pool, vt: VerifyTree = vt,
                             matchers: list = matchers, reqs: list = reqs) -> float:
                """One pooled build; returns the busiest worker's own time (ms)."""
                gt = GrammarTree.from_host(vt.next_token, vt.next_sibling, vt.draft_tokens,
                                           vt.parents)
                mask = build_grammar_vocab_mask_pooled(pool, reqs, matchers, gt, device="cpu")
                assert mask is not None and mask.mirror is not None
                return max(mask.mirror.worker_busy_ms)

            # mirrors start from the matchers' states: ship each request's accepted prefix
            for b, r in enumerate(reqs):
                r.output_ids = ids[: 40 + (b * 37) % (len(ids) - 80)]
            build_pooled()
            t0 = time.perf_counter()
            busy_ms = sum(build_pooled() for _ in range(args.reps)) / args.reps
            mask_ms = (time.perf_counter() - t0) / args.reps * 1e3
            print(f"mask_build tokenizer={name} vocab={vocab_size} batch={bs} nodes={n} "
                  f"processes={workers} build_ms={mask_ms:.3f} "
                  f"busiest_worker_ms={busy_ms:.3f} cores={os.cpu_count()}", flush=True)
            pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--workers", type=int, nargs="*", default=[],
                    help="also time the worker-process pool with these process counts")
    ap.add_argument("--num-nodes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    run_tokenizer("smollm2", resolve_model_path(None), 49152, args)
    if (LLAMA3_DIR / "tokenizer.json").exists():
        run_tokenizer("llama3", str(LLAMA3_DIR), 128256, args)


if __name__ == "__main__":
    main()
