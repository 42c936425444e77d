"""Host cost of cutting a step's drafted host trees to the sizer's plan (CPU, no model).

With the adaptive tree sizer on, every verify step whose plan is smaller than the drafter's
tree cuts each drafted host tree (n-gram) to its first ``--keep`` nodes
(:func:`structspec.scheduler.tree_fit.fit_trees`). The cut slices the drafter's layout
(:meth:`~structspec.draft_tree.layout.VerifyTree.prefix`); laying the cut columns out again
(:meth:`VerifyTree.from_parents`, what it did before) is the reference row. Steps that draft
only some requests (the sizer's plain rows, or its probes) put the cut rows beside root-only
rows: ``mixed_copy`` copies the cut rows' layouts into cached root-only rows (what
``fit_trees`` does), ``mixed_relayout`` lays the whole batch out again (what it did before);
``root_only_*`` the same for a step that drafts nobody. Random chain-heavy trees (80% of nodes
extend the previous one, as n-gram tries on JSON do), every other request drafted in the mixed
rows. One summary line per (batch, path): the median and minimum of ``--reps`` timed calls in
microseconds.

    PYTHONPATH=$PWD python benchmarks/host_tree_fit.py --batch 8 32 64 --nodes 8 --keep 5
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.scheduler.tree_fit import fit_trees


def chain_heavy_tree(batch: int, nodes: int, rng: random.Random) -> VerifyTree:
    """``[batch, nodes]`` host tree: each node extends the previous one with probability 0.8,
    else hangs under a random earlier node."""
    tokens = torch.randint(0, 50_000, (batch, nodes))
    parents = torch.zeros(batch, nodes, dtype=torch.int64)
    for r in range(batch):
        for i in range(1, nodes):
            parents[r, i] = i - 1 if rng.random() < 0.8 else rng.randrange(i)
    return VerifyTree.from_parents(tokens, parents)


def time_us(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median, min) of ``reps`` calls in microseconds, after ``reps // 10`` untimed ones."""
    for _ in range(max(1, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times)), float(min(times))


def paths(tree: VerifyTree, keep: int) -> dict[str, Callable[[], object]]:
    """The ways to fit ``tree`` (every row, then every other row, then no row drafted) to
    ``keep`` nodes: ``fit_trees`` and the layout from scratch."""
    bsz = tree.batch_size
    last = tree.draft_tokens[:, 0].tolist()
    drafted = list(range(bsz))
    tokens = tree.draft_tokens[:, :keep].contiguous()
    parents = tree.parents[:, :keep].contiguous()
    half = list(range(0, bsz, 2))
    sub = VerifyTree.from_parents(tree.draft_tokens[half].contiguous(),
                                  tree.parents[half].contiguous())
    mixed_tokens = torch.full((bsz, keep), -1, dtype=torch.int64)
    mixed_tokens[:, 0] = tree.draft_tokens[:, 0]
    mixed_tokens[half] = tokens[half]
    mixed_parents = torch.zeros((bsz, keep), dtype=torch.int64)
    mixed_parents[half] = parents[half]
    root_tokens = torch.full((bsz, keep), -1, dtype=torch.int64)
    root_tokens[:, 0] = tree.draft_tokens[:, 0]
    return {"prefix": lambda: fit_trees(last, drafted, tree, keep),
            "relayout": lambda: VerifyTree.from_parents(tokens, parents),
            "mixed_copy": lambda: fit_trees(last, half, sub, keep),
            "mixed_relayout": lambda: VerifyTree.from_parents(mixed_tokens, mixed_parents),
            "root_only_copy": lambda: fit_trees(last, [], None, keep),
            "root_only_relayout": lambda: VerifyTree.from_parents(
                root_tokens, torch.zeros_like(root_tokens))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--nodes", type=int, default=8, help="the drafter's tree size N")
    ap.add_argument("--keep", type=int, default=5, help="the plan's tree size (< N)")
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    if not 1 <= args.keep <= args.nodes:
        ap.error(f"--keep {args.keep}: must be in 1..--nodes ({args.nodes})")
    torch.set_num_threads(1)
    rng = random.Random(0)
    for batch in args.batch:
        tree = chain_heavy_tree(batch, args.nodes, rng)
        k = args.keep
        for name, fn in paths(tree, k).items():
            med, low = time_us(fn, args.reps)
            print(f"host_tree_fit batch={batch} nodes={args.nodes} keep={k} path={name} "
                  f"median_us={med:.0f} min_us={low:.0f}")


if __name__ == "__main__":
    main()
