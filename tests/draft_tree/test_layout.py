"""VerifyTree: links, depths and ancestor masks from parent lists."""

from __future__ import annotations

import pytest
import torch

from structspec.draft_tree.layout import VerifyTree


def test_links_match_sglang_example() -> None:
    # root 0 -> {1, 2}, 2 -> {3}, 1 -> {4}  (the N=5 example of the sglang digest)
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, 0, 0, 2, 1]])
    tree = VerifyTree.from_parents(tokens, parents)
    assert tree.next_token.tolist() == [[1, 4, 3, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, -1, -1]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    anc = tree.ancestor_mask[0].int().tolist()
    assert anc[3] == [1, 0, 1, 1, 0]
    assert anc[4] == [1, 1, 0, 0, 1]


def test_padding_nodes_are_unlinked() -> None:
    tokens = torch.tensor([[5, 6, -1, -1], [7, 8, 9, 3]])
    parents = torch.tensor([[-1, 0, 0, 0], [-1, 0, 1, 1]])
    tree = VerifyTree.from_parents(tokens, parents)
    assert tree.next_token[0].tolist() == [1, -1, -1, -1]
    assert tree.next_sibling[0].tolist() == [-1, -1, -1, -1]
    assert tree.next_token[1].tolist() == [1, 2, -1, -1]
    assert tree.next_sibling[1].tolist() == [-1, -1, 3, -1]
    assert tree.depth[1].tolist() == [0, 1, 2, 2]


def test_root_only() -> None:
    tree = VerifyTree.root_only(torch.tensor([4, 9]))
    assert tree.num_nodes == 1 and tree.next_token.tolist() == [[-1], [-1]]
    assert tree.ancestor_mask.all()


def test_host_and_torch_builds_agree_on_random_trees() -> None:
    """Both host paths (n-gram trees: plain Python up to batch 8, numpy above) and the torch
    path (device trees) are one layout, also for a real node whose parent is -1 (numpy's
    index -1 wrapped to the last node) and at 64 nodes (the list path's bitsets use all 64
    bits of a uint64)."""
    import random

    rng = random.Random(0)
    fields = ("draft_tokens", "parents", "depth", "next_token", "next_sibling", "ancestor_mask")
    for _ in range(300):
        b, n = rng.randint(1, 12), rng.choice([1, 2, 5, 8, 12, 33, 64])
        toks = torch.randint(0, 100, (b, n))
        par = torch.zeros(b, n, dtype=torch.int64)
        for r in range(b):
            for i in range(1, n):
                par[r, i] = rng.randrange(i) if rng.random() > 0.05 else -1  # under none
                if rng.random() < 0.2:
                    toks[r, i] = -1  # padding node
        if rng.random() < 0.2:
            par = par.to(torch.int32)  # parents keep their dtype on every path
        ref = VerifyTree._from_parents_torch(toks.clone(), par.clone())
        for build in (VerifyTree._from_parents_host, VerifyTree._from_parents_lists,
                      VerifyTree._from_parents_numpy):
            host = build(toks.clone(), par.clone())
            for f in fields:
                got, want = getattr(host, f), getattr(ref, f)
                assert got.dtype == want.dtype and torch.equal(got, want), (build, f)
    last = torch.tensor([5, 7])
    root = VerifyTree.root_only(last)
    ref = VerifyTree._from_parents_torch(last.view(-1, 1), torch.full((2, 1), -1))
    for f in fields:
        assert torch.equal(getattr(root, f), getattr(ref, f)), f


def test_prefix_equals_the_layout_of_the_cut_columns() -> None:
    """:meth:`VerifyTree.prefix` (the sizer's cut of a host tree) gives, field by field, what
    laying out the first ``k`` columns again gives, for every ``k``: links past the cut
    become -1 (first children and next siblings cut away, with later ones still in the
    prefix is what a wrong rule would keep), on random trees with padding nodes and real
    nodes under no parent; out-of-range sizes are refused."""
    import random

    rng = random.Random(1)
    fields = ("draft_tokens", "parents", "depth", "next_token", "next_sibling", "ancestor_mask")
    for _ in range(150):
        b, n = rng.randint(1, 12), rng.choice([2, 5, 8, 12, 16])
        toks = torch.randint(0, 100, (b, n))
        par = torch.zeros(b, n, dtype=torch.int64)
        for r in range(b):
            for i in range(1, n):
                par[r, i] = rng.randrange(i) if rng.random() > 0.05 else -1
                if rng.random() < 0.2:
                    toks[r, i] = -1
        tree = VerifyTree.from_parents(toks.clone(), par.clone())
        for k in range(1, n + 1):
            got = tree.prefix(k)
            want = VerifyTree._from_parents_torch(toks[:, :k].clone(), par[:, :k].clone())
            for f in fields:
                g, w = getattr(got, f), getattr(want, f)
                assert g.dtype == w.dtype and torch.equal(g, w), (k, f)
                assert g.is_contiguous()
    tree = VerifyTree.from_parents(torch.tensor([[3, 4, 5]]), torch.tensor([[-1, 0, 0]]))
    assert tree.prefix(3) is tree
    for bad in (0, 4):
        with pytest.raises(ValueError, match="num_nodes"):
            tree.prefix(bad)


def test_list_layout_refuses_more_than_64_nodes() -> None:
    with pytest.raises(ValueError, match="64"):
        VerifyTree._from_parents_lists(torch.arange(65).view(1, 65),
                                       torch.arange(-1, 64).view(1, 65))
    tree = VerifyTree.from_parents(torch.arange(65).view(1, 65), torch.arange(-1, 64).view(1, 65))
    assert tree.depth[0, -1] == 64  # the dispatcher sends it to the numpy passes
