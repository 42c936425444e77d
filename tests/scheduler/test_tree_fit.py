"""fit_trees on host trees: the copied-in rows equal the batch laid out from scratch."""

from __future__ import annotations

import random
import re

import pytest
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.scheduler.tree_fit import fit_trees, real_nodes

FIELDS = ("draft_tokens", "parents", "depth", "next_token", "next_sibling", "ancestor_mask")


def random_host_trees(rng: random.Random, rows: int, width: int) -> VerifyTree:
    """``[rows, width]`` host trees with trailing padding (as drafters pad)."""
    tokens = torch.full((rows, width), -1, dtype=torch.int64)
    parents = torch.zeros((rows, width), dtype=torch.int64)
    for r in range(rows):
        real = rng.randint(1, width)
        for i in range(real):
            tokens[r, i] = rng.randrange(50_000)
            parents[r, i] = -1 if i == 0 else rng.randrange(i)
    return VerifyTree.from_parents(tokens, parents)


def reference_fit(last_tokens: list[int], drafted: list[int], tree: VerifyTree | None,
                  num_nodes: int) -> VerifyTree:
    """The batch laid out from scratch: root-only rows, the drafted rows' first nodes."""
    bsz = len(last_tokens)
    tokens = torch.full((bsz, num_nodes), -1, dtype=torch.int64)
    tokens[:, 0] = torch.tensor(last_tokens)
    parents = torch.zeros((bsz, num_nodes), dtype=torch.int64)
    if tree is not None and drafted:
        idx = torch.tensor(drafted)
        tokens[idx] = tree.draft_tokens[:, :num_nodes]
        parents[idx] = tree.parents[:, :num_nodes]
    if num_nodes == 1:
        return VerifyTree.root_only(tokens[:, 0])
    return VerifyTree.from_parents(tokens, parents)


@pytest.mark.parametrize("bsz", [1, 3, 9, 40])
def test_host_fit_equals_the_batch_laid_out_again(bsz: int) -> None:
    rng = random.Random(bsz)
    for _ in range(30):
        width = rng.choice([2, 4, 8, 16])
        num_nodes = rng.randint(1, width)
        drafted = sorted(rng.sample(range(bsz), rng.randint(0, bsz)))
        tree = random_host_trees(rng, len(drafted), width) if drafted else None
        last = [rng.randrange(50_000) for _ in range(bsz)]
        got = fit_trees(last, drafted, tree, num_nodes)
        want = reference_fit(last, drafted, tree, num_nodes)
        for field in FIELDS:
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and a.shape == b.shape, field
            assert torch.equal(a, b), (field, num_nodes, drafted)


def test_root_only_rows_are_fresh_tensors() -> None:
    first = fit_trees([1, 2], [], None, 4)
    first.depth.fill_(7)
    first.draft_tokens[:, 0] = 99
    again = fit_trees([3, 4], [], None, 4)
    want = reference_fit([3, 4], [], None, 4)
    for field in FIELDS:
        assert torch.equal(getattr(again, field), getattr(want, field)), field


def test_real_nodes_counts_to_the_last_real_column() -> None:
    tree = VerifyTree.from_parents(torch.tensor([[5, 6, 7, -1], [8, -1, -1, -1], [1, 2, 3, 4]]),
                                   torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, 0], [-1, 0, 0, 2]]))
    assert real_nodes(tree) == [3, 1, 4]


@pytest.mark.parametrize("drafted,words", [
    ([0, -1], "drafted[1]=-1 is not a batch index: the batch has 4 rows"),
    ([-4, 1], "drafted[0]=-4 is not a batch index"),
    ([1, 4], "drafted[1]=4 is not a batch index: the batch has 4 rows"),
    ([0, 9], "drafted[1]=9 is not a batch index"),
    ([1, 1], "drafted[1]=1 repeats drafted[0]"),
    ([2, 0], "drafted[1]=0 is below drafted[0]=2"),
    ([0, 3, 2], "drafted[2]=2 is below drafted[1]=3"),
])
@pytest.mark.parametrize("width", [1, 4])
def test_drafted_that_is_not_ascending_batch_indices_is_refused(
        drafted: list[int], words: str, width: int) -> None:
    """``drafted`` was taken as given: a negative index wrote a row counted from the end, a
    repeated or unsorted one paired trees with the wrong rows (no error), one past the batch
    failed in numpy indexing, naming nothing."""
    tree = random_host_trees(random.Random(0), len(drafted), 4)
    with pytest.raises(ValueError, match=r"^" + re.escape(words)) as info:
        fit_trees([7, 8, 9, 10], drafted, tree, width)
    assert "drafted" in str(info.value)


def test_ascending_drafted_in_range_passes_as_any_sequence() -> None:
    from structspec.scheduler.tree_fit import check_drafted

    for drafted in ([], [0], [3], (0, 1, 2, 3), range(4), [0, 2, 3]):
        check_drafted(drafted, 4)
    with pytest.raises(ValueError, match=r"^drafted\[0\]=0 is not a batch index: the batch "
                                         r"has 0 rows"):
        check_drafted((0,), 0)
