"""Host cost of the n-gram drafter's ``propose``: per-request lookup vs the batched lookup.

``per_request`` is the single-request path for every request (``NgramDrafter.build_tree``:
:func:`continuation_starts`, ~10 numpy calls, then the trie merge); ``batched`` is
``NgramDrafter.propose`` (:func:`continuation_starts_batch` over all histories at once, then
the same merge). Both sync the cached histories and pack the same ``VerifyTree``; the script
checks the trees are equal. Workloads, ~``--length`` tokens a request:

* ``json``: Llama-3 tokens (``benchmarks/assets/llama3-8b-shape`` tokenizer) of a long JSON
  array of similar records, cut at a different point per request (a repetitive history, many
  earlier occurrences of the last token);
* ``random``: uniform random ids over the 128k vocabulary (almost no matches).

One summary line per (workload, batch): the mean history length, the mean number of earlier
occurrences of the last token (the candidates the lookup has to score), median ms per
``propose`` of each path and the speedup, and median ms of the lookup alone (per-request
``continuation_starts`` vs one ``continuation_starts_batch``), and median ms to hand the batch's
histories to the drafter: concatenating prompt + output ids per request (``history_copy``,
the scheduler before) vs a :class:`TokenHistory` view (``history_view``), and median ms to lay
out the batch's trees: :func:`pack_trees` (``VerifyTree.from_parents``' per-column passes,
``layout_passes``) vs the drafter's per-shape tables (``ShapeLayouts``, ``layout_shapes``). Calls are
interleaved. CPU only; pin one thread as the engine host does:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/ngram_draft.py --batch 1 8 32 64
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import CITY, FIRST, JOB, LAST  # noqa: E402
from structspec.config import SpecConfig  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.draft_tree.shape_layouts import ShapeLayouts, pack_trees  # noqa: E402
from structspec.speculative.base import DraftRequest, TokenHistory  # noqa: E402
from structspec.speculative.ngram import (  # noqa: E402
    NgramDrafter,
    continuation_starts,
    continuation_starts_batch,
)

TOKENIZER = Path(__file__).resolve().parent / "assets" / "llama3-8b-shape" / "tokenizer.json"


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def json_history(seed: int, length: int) -> list[int]:
    """Llama-3 ids of a JSON array of records, cut after a random token near ``length``."""
    rng = random.Random(seed)
    records = []
    for i in range(length // 8):
        records.append(
            f'{{"id": {i}, "name": "{rng.choice(FIRST)} {rng.choice(LAST)}", '
            f'"city": "{rng.choice(CITY)}", "job": "{rng.choice(JOB)}", '
            f'"age": {rng.randint(20, 70)}, "active": {rng.choice(["true", "false"])}}}')
    ids = tokenizer().encode('{"people": [' + ", ".join(records) + "]}", add_special_tokens=False).ids
    return ids[: length + rng.randint(-length // 20, length // 20)]


def random_history(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128_256, size=length).tolist()


def per_request(drafter: NgramDrafter, reqs: list[DraftRequest]) -> VerifyTree:
    """The path before batching: the single-request lookup and merge for every request."""
    trees = [drafter.build_tree(h) for h in drafter.sync_histories(reqs)]
    return pack_trees(trees, drafter.num_nodes)


def median_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms per call of each function, calls interleaved (fair under a noisy host)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(acc) * 1e3 for acc in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--length", type=int, default=900)
    ap.add_argument("--workloads", nargs="+", default=["json", "random"],
                    choices=["json", "random"])
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = SpecConfig(algorithm="ngram", num_draft_tokens=args.num_draft_tokens)
    make = {"json": json_history, "random": random_history}
    window = dict(min_window=spec.ngram_min_window, max_window=spec.ngram_max_window)
    for workload in args.workloads:
        pool = [make[workload](seed, args.length) for seed in range(max(args.batch))]
        for bs in args.batch:
            reqs = [DraftRequest(f"r{b}", pool[b], len(pool[b])) for b in range(bs)]
            drafter = NgramDrafter(spec)
            old, new = per_request(drafter, reqs), drafter.propose(reqs)
            for field in ("draft_tokens", "parents", "next_token", "next_sibling"):
                assert torch.equal(getattr(old, field), getattr(new, field)), field
            hists = drafter.sync_histories(reqs)
            split = [(pool[b][:60], pool[b][60:]) for b in range(bs)]  # prompt, output ids
            trees = [drafter.build_tree(h) for h in hists]
            layouts = ShapeLayouts(drafter.num_nodes)
            (old_ms, new_ms, old_lookup_ms, new_lookup_ms, copy_ms, view_ms, passes_ms,
             shapes_ms) = median_ms([
                lambda d=drafter, r=reqs: per_request(d, r),
                lambda d=drafter, r=reqs: d.propose(r),
                lambda h=hists: [continuation_starts(x, **window) for x in h],
                lambda h=hists: continuation_starts_batch(h, **window),
                lambda sp=split: [DraftRequest("r", p + o, 0) for p, o in sp],
                lambda sp=split: [DraftRequest("r", TokenHistory(p, o), 0) for p, o in sp],
                lambda t=trees, n=drafter.num_nodes: pack_trees(t, n),
                lambda t=trees, lay=layouts: lay.layout(t),
            ], args.repeats)
            occ = statistics.mean(int((np.asarray(h[:-1]) == h[-1]).sum()) for h in pool[:bs])
            length = statistics.mean(len(h) for h in pool[:bs])
            print(f"ngram_draft workload={workload} batch={bs} len={length:.0f} "
                  f"last_token_occurrences={occ:.1f} per_request_ms={old_ms:.3f} "
                  f"batched_ms={new_ms:.3f} speedup={old_ms / new_ms:.2f}x "
                  f"lookup_per_request_ms={old_lookup_ms:.3f} "
                  f"lookup_batched_ms={new_lookup_ms:.3f} "
                  f"history_copy_ms={copy_ms:.3f} history_view_ms={view_ms:.3f} "
                  f"layout_passes_ms={passes_ms:.3f} layout_shapes_ms={shapes_ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
