"""ShapeLayouts: the per-shape layout tables give ``VerifyTree.from_parents`` of the padded batch."""

from __future__ import annotations

import random

import pytest
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.shape_layouts import ShapeLayouts

FIELDS = ("draft_tokens", "parents", "depth", "next_token", "next_sibling", "ancestor_mask")


def from_scratch(trees: list[tuple[list[int], list[int]]], num_nodes: int) -> VerifyTree:
    """The reference: the trees padded (token -1, parent 0) and laid out from scratch."""
    shape = (len(trees), num_nodes)
    tokens = [[*t, *([-1] * (num_nodes - len(t)))] for t, _ in trees]
    parents = [[*p, *([0] * (num_nodes - len(p)))] for _, p in trees]
    return VerifyTree.from_parents(torch.tensor(tokens, dtype=torch.int64).reshape(shape),
                                   torch.tensor(parents, dtype=torch.int64).reshape(shape))


def random_tree(rng: random.Random, num_nodes: int) -> tuple[list[int], list[int]]:
    """A trie-like tree of 1..num_nodes real nodes: node 0's parent -1, others earlier nodes."""
    real = rng.randint(1, num_nodes)
    parents = [-1] + [rng.randrange(i) for i in range(1, real)]
    tokens = [rng.randrange(50_000) for _ in range(real)]
    return tokens, parents


def assert_same_layout(got: VerifyTree, want: VerifyTree) -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a, b), field


@pytest.mark.parametrize("num_nodes", [1, 4, 8, 16])
def test_layout_equals_the_layout_from_scratch_on_random_batches(num_nodes: int) -> None:
    rng = random.Random(num_nodes)
    layouts = ShapeLayouts(num_nodes)
    chain = (list(range(num_nodes)), list(range(-1, num_nodes - 1)))
    for _ in range(60):
        trees = [chain if rng.random() < 0.5 else random_tree(rng, num_nodes)
                 for _ in range(rng.randint(1, 12))]
        assert_same_layout(layouts.layout(trees), from_scratch(trees, num_nodes))
    assert len(layouts) >= 2 or num_nodes == 1


def test_tables_cleared_mid_batch_still_give_the_reference_layout() -> None:
    rng = random.Random(3)
    layouts = ShapeLayouts(8, max_shapes=3)
    for _ in range(40):  # batches with more shapes than the tables hold
        trees = [random_tree(rng, 8) for _ in range(rng.randint(1, 9))]
        assert_same_layout(layouts.layout(trees), from_scratch(trees, 8))
        assert len(layouts) <= 3


def test_returned_tensors_are_the_callers_own() -> None:
    layouts = ShapeLayouts(4)
    trees = [([5, 6, 7], [-1, 0, 1])]
    first = layouts.layout(trees)
    first.depth.fill_(9)
    first.ancestor_mask.fill_(False)
    assert_same_layout(layouts.layout(trees), from_scratch(trees, 4))


@pytest.mark.parametrize(("tree", "match"), [
    (([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3]), "at most 4 nodes"),
    (([1, 2], [-1, 1]), "earlier node"),
    (([1, 2], [0, 0]), "parent -1"),
    (([1, 2], [-1]), "one parent per token"),
])
def test_bad_trees_are_refused(tree: tuple[list[int], list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShapeLayouts(4).layout([tree])
    # also when the tables are cleared mid-batch (the batch is then laid out whole)
    small = ShapeLayouts(4, max_shapes=2)
    with pytest.raises(ValueError, match=match):
        small.layout([([1], [-1]), ([1, 2], [-1, 0]), ([1, 2, 3], [-1, 0, 0]), tree])


@pytest.mark.parametrize("max_shapes", [1, 4096])
def test_a_negative_real_token_is_refused(max_shapes: int) -> None:
    """A -1 in a real node would be padding to ``from_parents``: refused, not laid out."""
    layouts = ShapeLayouts(4, max_shapes=max_shapes)
    with pytest.raises(ValueError, match="negative"):
        layouts.layout([([1, 2], [-1, 0]), ([1, -1, 3], [-1, 0, 1])])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        ShapeLayouts(0)
    with pytest.raises(ValueError, match="max_shapes"):
        ShapeLayouts(4, max_shapes=0)


def test_an_empty_batch_has_empty_fields() -> None:
    assert_same_layout(ShapeLayouts(4).layout([]), from_scratch([], 4))
