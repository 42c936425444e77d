"""The ``ngram_eagle`` merge kernel against the torch reference it replaces
(:func:`structspec.speculative.tree_union.union_trees`): equal tokens and parents, element for
element, over random tries and EAGLE trees, ties, duplicated paths and non-finite scores."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

import structspec.kernels as kernels  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.kernels.tree_union import union_trees_kernel  # noqa: E402
from structspec.speculative.tree_union import union_trees  # noqa: E402
from tests.speculative.test_ngram_eagle import _random_tree  # noqa: E402


def _reference(*args: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    old = kernels.INDEX_KERNELS
    kernels.INDEX_KERNELS = False  # the torch path
    try:
        return union_trees(*args, max_depth=max_depth)
    finally:
        kernels.INDEX_KERNELS = old


def _batch(rng: random.Random, bsz: int, n: int, depth: int, vocab: int, dev: torch.device,
           special: bool) -> tuple[torch.Tensor, ...]:
    rows = []
    for _ in range(bsz):
        g = _random_tree(rng, n, rng.randrange(0, n), vocab, 6)
        e = _random_tree(rng, n, rng.randrange(0, n), vocab, depth)
        g_scores = [round(x, 1) if x != float("-inf") else -1e9 for x in g[2]]  # ties
        e_scores = [round(x, 1) for x in e[2]]
        if special:  # a broken head: NaN / +inf / -inf EAGLE scores on real nodes
            for i in range(1, n):
                if e[0][i] >= 0 and rng.random() < 0.3:
                    e_scores[i] = rng.choice([float("nan"), float("inf"), float("-inf")])
        rows.append((g[0], g[1], g_scores, e[0], e[1], e_scores))
    col = lambda i, dt=torch.int64: torch.tensor([r[i] for r in rows], dtype=dt)  # noqa: E731
    etree = VerifyTree.from_parents(col(3), col(4))
    return tuple(t.to(dev) for t in (col(0), col(1), col(2, torch.float32), etree.draft_tokens,
                                     etree.parents, etree.depth, col(5, torch.float32)))


@pytest.mark.parametrize(("n", "depth", "vocab", "special"),
                         [(8, 4, 3, False), (8, 4, 3, True), (6, 2, 2, False),
                          (12, 5, 4, True), (16, 4, 2, False), (1, 1, 3, False)])  # vocab ** depth holds the trees
def test_union_kernel_equals_the_torch_merge(dev: torch.device, n: int, depth: int,
                                             vocab: int, special: bool) -> None:
    rng = random.Random(n * 100 + depth * 10 + vocab + special)
    for _ in range(4):
        args = _batch(rng, 5, n, depth, vocab, dev, special)
        ref = _reference(*args, max_depth=depth)
        got = union_trees_kernel(*args, max_depth=depth)
        assert torch.equal(got[0].cpu(), ref[0].cpu())
        assert torch.equal(got[1].cpu(), ref[1].cpu())
        # union_trees dispatches to the kernel here
        via = union_trees(*args, max_depth=depth)
        assert torch.equal(via[0].cpu(), ref[0].cpu()) and torch.equal(via[1].cpu(),
                                                                       ref[1].cpu())


def test_union_kernel_refuses_trees_past_its_tiles(dev: torch.device) -> None:
    big = torch.zeros((1, 65), dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="65 nodes"):
        union_trees_kernel(big, big, big.float(), big, big, big, big.float(), max_depth=2)


@pytest.mark.parametrize("torch_ops", [False, True])
def test_other_dtypes_are_promoted(dev: torch.device, torch_ops: bool) -> None:
    # int32 trees / float64 scores (a caller other than the drafter) give the int64 / float32
    # inputs' result, through the kernel and through the torch ops
    rng = random.Random(7)
    args = _batch(rng, 3, 8, 4, 3, dev, special=False)
    ref = _reference(*args, max_depth=4)
    narrow = tuple(t.to(torch.int32) if t.dtype == torch.int64 else t.double() for t in args)
    got = _reference(*narrow, max_depth=4) if torch_ops else union_trees(*narrow, max_depth=4)
    assert got[0].dtype == got[1].dtype == torch.int64
    assert torch.equal(got[0].cpu(), ref[0].cpu()) and torch.equal(got[1].cpu(), ref[1].cpu())


def test_bad_shapes_and_depth_are_refused() -> None:
    t = torch.zeros((2, 4), dtype=torch.int64)
    f = t.float()
    for bad, match in ((torch.zeros(4, dtype=torch.int64), "expected \\[B, N\\]"),
                       (torch.zeros((2, 0), dtype=torch.int64), "N >= 1")):
        with pytest.raises(ValueError, match=match):
            union_trees(bad, bad, bad.float(), bad, bad, bad, bad.float(), max_depth=2)
    with pytest.raises(ValueError, match="max_depth=-1"):
        union_trees(t, t, f, t, t, t, f, max_depth=-1)
