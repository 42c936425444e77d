"""Host cost of settling a batch's tree bitmask rows (rejected and stop nodes' rows all ones,
grammar-rejected drafts counted): the engine's whole-batch settle after the mask workers'
replies (``settle_tree_rows_batch``) against one request's settle in a worker, right after
its walk (``settle_request_rows``).

    PYTHONPATH=$PWD python benchmarks/settle_cost.py --batch 8 32 64

One line per batch size: ``settle_cost bs=... batch_us=<median> per_request_us=<median>``,
over random 8-node trees with all-ones rows (every node reached: the most work) and the
default model's bitmask width (49,152 ids, 1,536 words).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structspec.grammar.tree_mask import settle_request_rows, settle_tree_rows_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--words", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, width = args.nodes, args.words
    stops = frozenset([2])
    for bs in args.batch:
        parents = np.zeros((bs, n), dtype=np.int64)
        parents[:, 0] = -1
        for j in range(1, n):
            parents[:, j] = rng.integers(0, j, size=bs)
        tokens = rng.integers(0, 32 * width, size=(bs, n))
        rows = torch.full((bs * n, width), -1, dtype=torch.int32)
        batch_s, one_s = [], []
        for _ in range(args.reps):
            fresh = rows.clone()
            t0 = time.perf_counter()
            settle_tree_rows_batch(fresh, torch.from_numpy(tokens), torch.from_numpy(parents),
                                   list(range(bs)), stop_token_ids=list(stops))
            batch_s.append(time.perf_counter() - t0)
            words = rows.clone().numpy().reshape(bs, n, width)
            t0 = time.perf_counter()
            settle_request_rows(words[0], tokens[0].tolist(), parents[0].tolist(), stops)
            one_s.append(time.perf_counter() - t0)
        print(f"settle_cost bs={bs} N={n} batch_us={statistics.median(batch_s) * 1e6:.1f} "
              f"per_request_us={statistics.median(one_s) * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    main()
