"""Draft-tree kernels (EAGLE-2 expansion steps, node selection, tree layout) against the torch
reference ops they replace: equal element for element, ties included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import structspec.kernels as kernels  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.kernels import draft_tree  # noqa: E402
from structspec.speculative import expansion  # noqa: E402


def _step_fn_factory(vocab: int, device: torch.device, *, ties: bool, seen: list):
    """A deterministic stand-in for a draft forward: log-probs of the children of each
    frontier node, a function of (step, node token, parent); records the scratch masks."""

    def step_fn(step: int, tokens: torch.Tensor, parent: torch.Tensor,
                scratch_mask: torch.Tensor) -> torch.Tensor:
        seen.append((step, tokens.clone(), parent.clone(), scratch_mask.clone()))
        bsz, k = tokens.shape
        g = torch.Generator().manual_seed(1000 * step + int(tokens.sum()) + int(parent.sum()))
        if ties:  # few distinct values: many equal log-probs
            logits = torch.randint(0, 3, (bsz, k, vocab), generator=g).float()
        else:
            logits = torch.randn(bsz, k, vocab, generator=g)
        return torch.log_softmax(logits, dim=-1).to(device)

    return step_fn


@pytest.mark.parametrize("topk,depth,num_nodes", [(2, 4, 8), (1, 3, 4), (3, 3, 10), (4, 2, 6),
                                                  (2, 1, 3), (2, 3, 16), (4, 4, 40)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_expand_tree_kernels_match_the_torch_expansion(
    dev: torch.device, topk: int, depth: int, num_nodes: int, ties: bool, mapped: bool
) -> None:
    bsz, vocab = 3, 300
    g = torch.Generator().manual_seed(topk * 100 + depth * 10 + num_nodes + ties)
    if ties:
        root = torch.log_softmax(torch.randint(0, 3, (bsz, vocab), generator=g).float(), -1)
    else:
        root = torch.log_softmax(torch.randn(bsz, vocab, generator=g), -1)
    vocab_map = torch.randperm(5000, generator=g)[:vocab].to(dev) if mapped else None
    root = root.to(dev)
    runs = []
    for use_kernels in (False, True):
        seen: list = []
        fn = _step_fn_factory(vocab, dev, ties=ties, seen=seen)
        if use_kernels:
            tree = expansion._expand_tree_kernels(root, fn, k=topk, depth=depth,
                                                  num_nodes=num_nodes, vocab_map=vocab_map)
        else:
            old = kernels.INDEX_KERNELS
            kernels.INDEX_KERNELS = False  # the torch reference path
            try:
                tree = expansion.expand_tree(root, fn, topk=topk, depth=depth,
                                             num_nodes=num_nodes, vocab_map=vocab_map)
            finally:
                kernels.INDEX_KERNELS = old
        runs.append((tree, seen))
    (ref, ref_seen), (got, got_seen) = runs
    assert torch.equal(got.tokens.cpu(), ref.tokens.cpu())
    assert torch.equal(got.parents.cpu(), ref.parents.cpu())
    assert torch.equal(got.scores.cpu(), ref.scores.cpu())
    assert len(got_seen) == len(ref_seen) == depth - 1
    for (s1, t1, p1, m1), (s2, t2, p2, m2) in zip(got_seen, ref_seen, strict=True):
        assert s1 == s2
        assert torch.equal(t1.cpu(), t2.cpu())  # frontier tokens (target ids)
        assert torch.equal(p1.cpu(), p2.cpu())  # parents in the previous frontier
        assert torch.equal(m1.cpu(), m2.cpu())  # scratch columns each node sees


def test_expand_tree_dispatches_to_the_kernels_where_usable(dev: torch.device) -> None:
    """The default entry point takes the kernel path on a kernel device (the interpreter's
    CPU included) and the torch path when disabled; same tree either way."""
    root = torch.log_softmax(torch.randn(2, 64, generator=torch.Generator().manual_seed(3)),
                             -1).to(dev)
    calls = []

    def fn(step, tokens, parent, mask):
        calls.append(step)
        return torch.log_softmax(torch.arange(64.0, device=dev).flip(0).repeat(2, 2, 1)
                                 + tokens[..., None] * 0.01, -1)

    assert expansion._tree_kernels_apply(root, 2, 3, 8)
    fused = expansion.expand_tree(root, fn, topk=2, depth=3, num_nodes=8)
    old = kernels.INDEX_KERNELS
    kernels.INDEX_KERNELS = False
    try:
        assert not expansion._tree_kernels_apply(root, 2, 3, 8)
        plain = expansion.expand_tree(root, fn, topk=2, depth=3, num_nodes=8)
    finally:
        kernels.INDEX_KERNELS = old
    assert torch.equal(fused.tokens, plain.tokens) and torch.equal(fused.parents, plain.parents)
    assert not expansion._tree_kernels_apply(root, 5, 3, 8)  # topk above MAX_TOPK: torch


@pytest.mark.parametrize("num_cand,num_nodes", [(14, 8), (5, 8), (40, 17), (3, 1), (200, 64)])
def test_select_nodes_matches_select_top_nodes(dev: torch.device, num_cand: int,
                                               num_nodes: int) -> None:
    bsz = 4
    g = torch.Generator().manual_seed(num_cand + num_nodes)
    # a valid candidate forest: each candidate's parent is an earlier one (or the root) with a
    # score at least its own; integer-valued scores make ties common
    parents = torch.full((bsz, num_cand), -1, dtype=torch.int64)
    scores = torch.zeros(bsz, num_cand)
    for b in range(bsz):
        for c in range(num_cand):
            p = int(torch.randint(-1, c, (1,), generator=g)) if c else -1
            parents[b, c] = p
            drop = float(torch.randint(0, 3, (1,), generator=g))
            scores[b, c] = (scores[b, p] if p >= 0 else 0.0) - drop
    scores[0, -1] = float("nan")  # ranks last, as in the reference
    tokens = torch.randint(0, 1000, (bsz, num_cand), generator=g)
    ref = expansion.select_top_nodes(scores, tokens, parents, num_nodes)
    got = draft_tree.select_nodes(scores.to(dev), tokens.to(dev), parents.to(dev), num_nodes)
    assert torch.equal(got[0].cpu(), ref.tokens)
    assert torch.equal(got[1].cpu(), ref.parents)
    assert torch.equal(got[2].cpu().nan_to_num(7.0), ref.scores.nan_to_num(7.0))


def _random_trees(bsz: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (bsz, n), generator=g)
    parents = torch.zeros(bsz, n, dtype=torch.int64)
    parents[:, 0] = -1
    for b in range(bsz):
        real = [0]
        for i in range(1, n):
            if float(torch.rand(1, generator=g)) < 0.25:  # a padding node
                tokens[b, i] = -1
                parents[b, i] = int(torch.randint(-1, n, (1,), generator=g))  # ignored
            else:
                parents[b, i] = real[int(torch.randint(0, len(real), (1,), generator=g))]
                real.append(i)
    return tokens, parents


@pytest.mark.parametrize("n", [1, 2, 8, 13, 64, 128])
def test_tree_layout_matches_from_parents(dev: torch.device, n: int) -> None:
    tokens, parents = _random_trees(5, n, seed=n)
    ref = VerifyTree._from_parents_torch(tokens, parents)
    got = draft_tree.tree_layout(tokens.to(dev), parents.to(dev))
    for name, value in zip(("parents", "depth", "next_token", "next_sibling", "ancestor_mask"),
                           got, strict=True):
        assert torch.equal(value.cpu(), getattr(ref, name)), name


def test_tree_layout_of_a_chain_and_of_a_star(dev: torch.device) -> None:
    chain = torch.tensor([[7, 8, 9, 10]])
    chain_par = torch.tensor([[-1, 0, 1, 2]])
    star = torch.tensor([[7, 8, 9, 10]])
    star_par = torch.tensor([[-1, 0, 0, 0]])
    par, depth, first, sib, anc = draft_tree.tree_layout(
        torch.cat([chain, star]).to(dev), torch.cat([chain_par, star_par]).to(dev))
    assert depth.cpu().tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]
    assert first.cpu().tolist() == [[1, 2, 3, -1], [1, -1, -1, -1]]
    assert sib.cpu().tolist() == [[-1, -1, -1, -1], [-1, 2, 3, -1]]
    assert anc[0].cpu().tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    assert par.cpu().tolist() == [[-1, 0, 1, 2], [-1, 0, 0, 0]]


@pytest.mark.parametrize("vocab", [4, 5, 300])
@pytest.mark.parametrize("mapped", [False, True])
def test_nan_log_probs_give_the_reference_tree_and_in_range_ids(
    dev: torch.device, vocab: int, mapped: bool
) -> None:
    """A broken head's NaN log-probs (all of a row, or some): the kernels rank NaN as the
    torch ops do (first among a node's children, as -inf among scores) and never emit an id
    outside the draft vocabulary (an all-NaN row once gave id ``V``, read past the map)."""
    g = torch.Generator().manual_seed(vocab)
    root = torch.log_softmax(torch.randn(3, vocab, generator=g), -1)
    root[0] = float("nan")  # all NaN
    root[1, ::3] = float("nan")  # some NaN
    backing = torch.arange(10_000, 10_000 + vocab + 64)
    vocab_map = backing[:vocab].to(dev) if mapped else None  # a view of a longer buffer

    def fn(step, tokens, parent, mask):
        logits = torch.randn(tokens.shape[0], tokens.shape[1], vocab, generator=g)
        logits[0] = float("nan")
        return torch.log_softmax(logits, -1).to(dev)

    g_state = g.get_state()
    got = expansion._expand_tree_kernels(root.to(dev), fn, k=2, depth=3, num_nodes=8,
                                         vocab_map=vocab_map)
    g.set_state(g_state)
    old = kernels.INDEX_KERNELS
    kernels.INDEX_KERNELS = False
    try:
        ref = expansion.expand_tree(root.to(dev), fn, topk=2, depth=3, num_nodes=8,
                                    vocab_map=vocab_map)
    finally:
        kernels.INDEX_KERNELS = old
    assert torch.equal(got.tokens.cpu(), ref.tokens.cpu())
    assert torch.equal(got.parents.cpu(), ref.parents.cpu())
    assert torch.equal(got.scores.cpu().nan_to_num(7.0), ref.scores.cpu().nan_to_num(7.0))
    real = got.tokens[:, 1:].cpu()
    real = real[real >= 0]
    low, high = (10_000, 10_000 + vocab) if mapped else (0, vocab)
    assert bool(((real >= low) & (real < high)).all())


def test_nan_and_minus_inf_scores_rank_alike_in_both_paths(dev: torch.device) -> None:
    scores = torch.tensor([[float("nan"), float("-inf"), -1.0, float("-inf"), float("nan")]])
    tokens = torch.arange(5).unsqueeze(0)
    parents = torch.full((1, 5), -1)
    ref = expansion.select_top_nodes(scores, tokens, parents, 4)
    got = draft_tree.select_nodes(scores.to(dev), tokens.to(dev), parents.to(dev), 4)
    assert ref.tokens.tolist() == [[-1, 0, 1, 2]]  # -1.0 first, then NaN / -inf by index
    assert torch.equal(got[0].cpu(), ref.tokens) and torch.equal(got[1].cpu(), ref.parents)
