"""Why the tree-mask walks use processes, not threads: xgrammar walks under thread contention.

Times ``traverse_draft_tree`` over a batch of JSON-Schema matchers (8-node trees, SmolLM2
vocabulary) three ways, one summary line each: one thread alone; two threads walking disjoint
batches (speedup = 2 x work / wall time); one walking thread next to a thread spinning in
Python (slowdown). No GPU needed::

    PYTHONPATH=$PWD python benchmarks/gil_handoff.py --batch 32 --reps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA  # noqa: E402
from benchmarks.mask_build import sample_text  # noqa: E402
from structspec.constraints import JsonSchemaConstraint  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.grammar.backend import GrammarBackend  # noqa: E402
from structspec.grammar.bitmask import allocate_bitmask  # noqa: E402
from structspec.models.default_model import resolve_model_path  # noqa: E402
from structspec.models.tokenizer import Tokenizer  # noqa: E402

N = 8


def make_batch(backend: GrammarBackend, compiled: object, ids: list[int], bs: int) -> list:
    """``bs`` (matcher, next_token, next_sibling, draft_tokens, rows) walks at spread states."""
    out = []
    for b in range(bs):
        pos = 40 + (b * 37) % (len(ids) - 80)
        m = backend.create_matcher(compiled)
        m.accept_run(ids[:pos])
        chain = ids[pos - 1: pos - 1 + N - 1] + [ids[pos + 3]]  # chain + one wrong branch
        vt = VerifyTree.from_parents(torch.tensor([chain]),
                                     torch.tensor([list(range(-1, N - 2)) + [1]]))
        out.append((m.xgr_matcher, vt.next_token[0].clone(), vt.next_sibling[0].clone(),
                    vt.draft_tokens[0].clone(), allocate_bitmask(N, backend.vocab_size,
                                                                 pin=False)))
    return out


def walk(batch: list, reps: int) -> None:
    for _ in range(reps):
        for m, nt, ns, dt, rows in batch:
            m.traverse_draft_tree(nt, ns, dt, rows, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    tok = Tokenizer(resolve_model_path(None))
    backend = GrammarBackend(tok.hf, vocab_size=49152, stop_token_ids=list(tok.eos_token_ids))
    compiled = backend.compile(JsonSchemaConstraint(LONG_SCHEMA))
    ids = tok.hf.encode(sample_text(200), add_special_tokens=False)
    a, b = (make_batch(backend, compiled, ids, args.batch) for _ in range(2))
    walk(a, 2)
    t0 = time.perf_counter()
    walk(a, args.reps)
    alone = time.perf_counter() - t0
    per_tree_us = alone / args.reps / args.batch * 1e6
    print(f"gil_handoff mode=one_thread batch={args.batch} ms_per_batch="
          f"{alone / args.reps * 1e3:.3f} us_per_tree={per_tree_us:.1f} cores={os.cpu_count()}")
    threads = [threading.Thread(target=walk, args=(x, args.reps)) for x in (a, b)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = time.perf_counter() - t0
    print(f"gil_handoff mode=two_threads batch={args.batch} speedup={2 * alone / both:.2f}x")
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    t0 = time.perf_counter()
    walk(a, args.reps)
    spun = time.perf_counter() - t0
    stop.set()
    spinner.join()
    print(f"gil_handoff mode=next_to_python_spinner batch={args.batch} "
          f"slowdown={spun / alone:.1f}x")


if __name__ == "__main__":
    main()
