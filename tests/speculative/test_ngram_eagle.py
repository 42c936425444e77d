"""The ``ngram_eagle`` drafter's parts: the device tree union, the per-request node split, the
credit of accepted drafts, and the n-gram trie under a per-request budget. (Lossless end to end:
``tests/engine/test_spec.py``, ``ngram_eagle``.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import DraftRequest
from structspec.speculative.branch_split import BranchSplit, ngram_credit
from structspec.speculative.ngram import NgramDrafter, pack_trees
from structspec.speculative.registry import drafter_info, drafter_names
from structspec.speculative.tree_union import union_trees


def _random_tree(rng: random.Random, n: int, real: int, vocab: int, max_depth: int,
                 ) -> tuple[list[int], list[int], list[float]]:
    """A tree of ``real`` drafts (root token 0), siblings distinct, depth <= ``max_depth``,
    scores never above the parent's; padded to ``n`` nodes."""
    toks, pars, depth, scores = [0], [-1], [0], [0.0]
    while len(toks) < real + 1:
        p = rng.randrange(len(toks))
        if depth[p] >= max_depth:
            continue
        used = {toks[j] for j in range(len(toks)) if pars[j] == p}
        free = [t for t in range(1, vocab + 1) if t not in used]
        if not free:
            continue
        toks.append(rng.choice(free))
        pars.append(p)
        depth.append(depth[p] + 1)
        scores.append(scores[p] + np.log(rng.uniform(0.05, 1.0)))
    pad = n - len(toks)
    return toks + [-1] * pad, pars + [0] * pad, scores + [float("-inf")] * pad


def _paths(toks: list[int], pars: list[int]) -> list[tuple[int, ...] | None]:
    out: list[tuple[int, ...] | None] = [()]
    for i in range(1, len(toks)):
        if toks[i] < 0:
            out.append(None)
            continue
        parent = out[pars[i]]
        assert parent is not None
        out.append((*parent, toks[i]))
    return out


def _reference(g_toks: list[int], g_pars: list[int], e_toks: list[int], e_pars: list[int],
               e_scores: list[float], n: int) -> tuple[list[int], list[int]]:
    """The union in plain Python: the trie's nodes, then the best new EAGLE nodes in EAGLE
    order."""
    g_paths = _paths(g_toks, g_pars)
    e_paths = _paths(e_toks, e_pars)
    known = {p: i for i, p in enumerate(g_paths) if p is not None}
    num_g = sum(t >= 0 for t in g_toks[1:])
    new = [i for i in range(1, n) if e_paths[i] is not None and e_paths[i] not in known]
    best = sorted(new, key=lambda i: (-e_scores[i], i))[: n - 1 - num_g]
    toks, pars = list(g_toks), [-1, *g_pars[1:]]
    col = num_g + 1
    for i in sorted(best):
        path = e_paths[i]
        assert path is not None
        toks[col] = e_toks[i]
        pars[col] = known[path[:-1]]
        known[path] = col
        col += 1
    return toks, pars


@pytest.mark.parametrize("seed", range(6))
def test_union_matches_the_reference_and_is_a_tree(seed: int) -> None:
    rng = random.Random(seed)
    n, depth, bsz = 10, 3, 8
    rows = []
    for _ in range(bsz):
        g = _random_tree(rng, n, rng.randrange(0, n), vocab=3, max_depth=6)
        e = _random_tree(rng, n, rng.randrange(0, n), vocab=3, max_depth=depth)
        rows.append((g, e))
    t = lambda i, dt=torch.int64: torch.tensor([r[i // 3][i % 3] for r in rows], dtype=dt)  # noqa: E731
    etree = VerifyTree.from_parents(t(3), t(4))
    tokens, parents = union_trees(t(0), t(1), etree.draft_tokens, etree.parents, etree.depth,
                                  t(5, torch.float32), max_depth=depth)
    for b, (g, e) in enumerate(rows):
        want = _reference(g[0], g[1], e[0], e[1], e[2], n)
        assert (tokens[b].tolist(), parents[b].tolist()) == want, b
        paths = [p for p in _paths(*want) if p is not None]
        assert len(paths) == len(set(paths))  # merged: no two nodes on one path
    tree = VerifyTree.from_parents(tokens, parents)  # a valid tree: parents before children
    real = tokens >= 0
    assert (parents[:, 1:][real[:, 1:]] < torch.arange(1, n).expand(bsz, -1)[real[:, 1:]]).all()
    assert tree.batch_size == bsz


def test_union_merges_a_shared_first_token_and_fills_free_slots_by_score() -> None:
    # trie: root -> 5 -> 6 -> 7; EAGLE: root -> 5 -> 9 (0.5), root -> 8 (0.3), 5 -> 6 dup
    g_toks = torch.tensor([[1, 5, 6, 7, -1, -1]])
    g_pars = torch.tensor([[-1, 0, 1, 2, 0, 0]])
    e_toks = torch.tensor([[1, 5, 8, 6, 9, -1]])
    e_pars = torch.tensor([[-1, 0, 0, 1, 1, 0]])
    e_scores = torch.tensor([[0.0, -0.1, -1.2, -0.2, -0.7, float("-inf")]])
    etree = VerifyTree.from_parents(e_toks, e_pars)
    tokens, parents = union_trees(g_toks, g_pars, etree.draft_tokens, etree.parents,
                                  etree.depth, e_scores, max_depth=2)
    # 5 and 5->6 merge into the trie; 5->9 (better score) and 8 take the two free slots
    assert tokens.tolist() == [[1, 5, 6, 7, 8, 9]]
    assert parents.tolist() == [[-1, 0, 1, 2, 0, 1]]


def test_branch_split_follows_credit_and_reprobes_a_starved_eagle() -> None:
    even = BranchSplit()
    assert even.ngram_nodes("a", 7) in (3, 4) and even.ngram_nodes("a", 1) in (0, 1)
    split = BranchSplit(start_ngram=10.0, start_eagle=1e-3, probe_every=2, max_probe_every=4)
    # EAGLE's share rounds to 0 nodes: one probe node every 2 steps, then every 4 after a miss
    got = []
    for _ in range(8):
        got.append(split.ngram_nodes("a", 7))
        split.observe("a", 6, 0 if got[-1] == 6 else None)
    assert got == [7, 6, 7, 7, 7, 6, 7, 7]
    # a new request starts from the engine's averages (which favour the n-gram branch here)
    assert split.share("b") > 0.9
    for _ in range(20):
        split.ngram_nodes("a", 7)
        split.observe("a", 0, 3)
    assert split.ngram_nodes("a", 7) == 0
    split.observe("a", None, None)  # nothing proposed: nothing learned
    assert split.ngram_nodes("a", 7) == 0
    split.release("a")
    split.release("b")
    assert split.num_tracked() == 0
    with pytest.raises(ValueError, match="probe_every"):
        BranchSplit(probe_every=0)


def test_ngram_credit_counts_the_accepted_prefix_on_the_trie() -> None:
    toks, pars = [1, 5, 6, 7, 8], [-1, 0, 1, 2, 0]
    assert ngram_credit(toks, pars, [5, 6, 9]) == 2
    assert ngram_credit(toks, pars, [8]) == 1
    assert ngram_credit(toks, pars, [9, 5]) == 0
    assert ngram_credit(toks, pars, []) == 0


def test_ngram_budgets_cut_the_full_trie() -> None:
    drafter = NgramDrafter(SpecConfig(algorithm="ngram", num_draft_tokens=8))
    hist = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1, 2]
    reqs = [DraftRequest("a", hist, len(hist) - 1), DraftRequest("b", hist[:9], 8)]
    full = drafter.propose(reqs)
    for budgets in ([8, 8], [3, 1], [1, 5]):
        lists = drafter.propose_lists(reqs, budgets)
        for b, (toks, pars) in enumerate(lists):
            assert len(toks) <= budgets[b] and toks[0] == hist[: len(reqs[b].token_ids)][-1]
            # a budget keeps the first nodes of the full trie (merge order)
            assert toks == full.draft_tokens[b, : len(toks)].tolist()
            assert pars[1:] == full.parents[b, 1: len(toks)].tolist()
    assert pack_trees(drafter.propose_lists(reqs, [8, 8]), 8).draft_tokens.equal(
        full.draft_tokens)
    with pytest.raises(ValueError, match="budgets"):
        drafter.propose_lists(reqs, [8])


def test_registered_with_an_eagle_head() -> None:
    assert "ngram_eagle" in drafter_names()
    info = drafter_info("ngram_eagle")
    assert info.eagle_head and info.needs_draft_model and info.expands_tree
