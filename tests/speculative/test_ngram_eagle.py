"""The ``ngram_eagle`` drafter's parts: the device tree union ranked by both trees' scores, the
annotated n-gram trie, and the trie confidence learned from committed runs. (Lossless end to end:
``tests/engine/test_spec.py``, ``ngram_eagle``.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import DraftRequest
from structspec.speculative.ngram import AnnotatedTrie, NgramDrafter, suffix_match_length
from structspec.speculative.ngram_confidence import TrieConfidence, prior_accept, support_level
from structspec.speculative.ngram_eagle import NgramEagleDrafter
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


def _reference(g_toks: list[int], g_pars: list[int], g_scores: list[float], e_toks: list[int],
               e_pars: list[int], e_scores: list[float], n: int) -> tuple[list[int], list[int]]:
    """The union in plain Python: every path of either tree once (a shared path scored by
    the better score), the best ``n - 1`` by (score, trie first, index), in rank order."""
    g_paths = _paths(g_toks, g_pars)
    e_paths = _paths(e_toks, e_pars)
    score: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for i, p in enumerate(g_paths):
        if p is not None and i > 0:
            score[p], order[p] = g_scores[i], i
    for i, p in enumerate(e_paths):
        if p is not None and i > 0:
            if p in score:
                score[p] = max(score[p], e_scores[i])
            else:
                score[p], order[p] = e_scores[i], n + i
    best = sorted(score, key=lambda p: (-score[p], order[p]))[: n - 1]
    col = {(): 0}
    toks, pars = [g_toks[0]], [-1]
    for p in best:
        assert p[:-1] in col  # closed under ancestors, parents first
        col[p] = len(toks)
        toks.append(p[-1])
        pars.append(col[p[:-1]])
    pad = n - len(toks)
    return toks + [-1] * pad, pars + [0] * pad


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
    tokens, parents = union_trees(t(0), t(1), t(2, torch.float32), etree.draft_tokens,
                                  etree.parents, etree.depth, t(5, torch.float32),
                                  max_depth=depth)
    # int32 trees and float64 scores are promoted: the same merge
    narrow = union_trees(t(0, torch.int32), t(1, torch.int32), t(2, torch.float64),
                         etree.draft_tokens.int(), etree.parents.int(), etree.depth.int(),
                         t(5, torch.float64), max_depth=depth)
    assert torch.equal(narrow[0], tokens) and torch.equal(narrow[1], parents)
    for b, (g, e) in enumerate(rows):
        want = _reference(*g, *e, n)
        assert (tokens[b].tolist(), parents[b].tolist()) == want, b
        paths = [p for p in _paths(*want) if p is not None]
        assert len(paths) == len(set(paths))  # merged: no two nodes on one path
    tree = VerifyTree.from_parents(tokens, parents)  # a valid tree: parents before children
    real = tokens >= 0
    assert (parents[:, 1:][real[:, 1:]] < torch.arange(1, n).expand(bsz, -1)[real[:, 1:]]).all()
    assert tree.batch_size == bsz


def test_union_merges_a_shared_path_and_ranks_both_trees_together() -> None:
    # trie: root -> 5 -> 6 -> 7, a guess past its first node (scores -0.1, -2.0, -3.0);
    # EAGLE: root -> 5 -> 9 (-0.5), root -> 8 (-1.2), 5 -> 6 (-0.2, a duplicate)
    g_toks = torch.tensor([[1, 5, 6, 7, -1]])
    g_pars = torch.tensor([[-1, 0, 1, 2, 0]])
    g_scores = torch.tensor([[0.0, -0.1, -2.0, -3.0, 0.0]])
    e_toks = torch.tensor([[1, 5, 8, 6, 9]])
    e_pars = torch.tensor([[-1, 0, 0, 1, 1]])
    e_scores = torch.tensor([[0.0, -0.1, -1.2, -0.2, -0.5]])
    etree = VerifyTree.from_parents(e_toks, e_pars)
    tokens, parents = union_trees(g_toks, g_pars, g_scores, etree.draft_tokens, etree.parents,
                                  etree.depth, e_scores, max_depth=2)
    # 5 and 5->6 merge (5->6 scored by EAGLE's -0.2); then 5->9 (-0.5) beats 8 (-1.2) and
    # the trie's 5->6->7 (-3.0): four slots, root first
    assert tokens.tolist() == [[1, 5, 6, 9, 8]]
    assert parents.tolist() == [[-1, 0, 1, 1, 0]]
    # a confident trie (long match) keeps its chain and leaves EAGLE the last slot
    tokens, parents = union_trees(g_toks, g_pars, torch.tensor([[0.0, -0.05, -0.1, -0.15, 0.0]]),
                                  etree.draft_tokens, etree.parents, etree.depth, e_scores,
                                  max_depth=2)
    assert tokens.tolist() == [[1, 5, 6, 7, 9]]
    assert parents.tolist() == [[-1, 0, 1, 2, 1]]


def test_annotated_trie_is_the_propose_trie_with_match_and_support() -> None:
    drafter = NgramDrafter(SpecConfig(algorithm="ngram", num_draft_tokens=8))
    hist = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1, 2]
    reqs = [DraftRequest("a", hist, len(hist) - 1), DraftRequest("b", hist[:9], 8)]
    full = drafter.propose(reqs)
    tries = drafter.annotated_tries(reqs)
    for b, trie in enumerate(tries):
        k = len(trie.tokens)
        assert trie.tokens == full.draft_tokens[b, :k].tolist()
        assert trie.parents[1:] == full.parents[b, 1:k].tolist()
    a = tries[0]
    # "... 1 2" matched at 3 earlier places, each a 2-token match: all pass through 3
    assert a.tokens[:2] == [2, 3] and a.match[1] == 2 and a.support[1] == 3
    assert suffix_match_length(np.asarray(hist), 2, 8) == 2


def test_confidence_learns_from_the_committed_run() -> None:
    conf = TrieConfidence(max_match=4, prior_strength=2.0)
    # root 9 -> 5 -> 6 -> 7 from a 1-token match; branch 9 -> 8 from a 1-token match
    trie = AnnotatedTrie(tokens=[9, 5, 6, 7, 8], parents=[-1, 0, 1, 2, 0],
                         match=[0, 1, 1, 1, 1], support=[0, 1, 1, 1, 1])
    p = [conf.accept_prob(m, 1) for m in range(5)]
    assert p[1] == pytest.approx(prior_accept(1, 0)) and p[3] == pytest.approx(prior_accept(3, 0))
    logp = conf.path_logp(trie)
    # depth d of a 1-token match: the effective match is d tokens
    assert logp[0] == 0.0 and logp[3] == pytest.approx(np.log(p[1] * p[2] * p[3]))
    assert logp[4] == pytest.approx(np.log(p[1]))
    assert all(logp[i] <= logp[trie.parents[i]] for i in range(1, 5))
    # run 5, 6, 4 (bonus): 5 and 6 accepted, 7 and 8 rejected (buckets 1, 2, 3 and 1)
    conf.observe(trie, [5, 6, 4])
    assert conf.trials[1:4, 0].tolist() == pytest.approx([4.0, 3.0, 3.0])
    assert conf.hits[1:4, 0].tolist() == pytest.approx([2 * p[1] + 1, 2 * p[2] + 1, 2 * p[3]])
    # a node deeper than the run is not tested: only 5 (hit) and 8 (miss)
    conf.observe(trie, [5])
    assert conf.trials[1:4, 0].tolist() == pytest.approx([6.0, 3.0, 3.0])
    # the scores follow the updated estimates (path_logp's log table is rebuilt)
    q = [conf.accept_prob(m, 1) for m in range(5)]
    assert q[1] != p[1]
    assert conf.path_logp(trie)[3] == pytest.approx(np.log(q[1] * q[2] * q[3]))
    assert TrieConfidence.effective_match(2, 3) == 4
    assert support_level(1) == 0 and support_level(3) == 1 and support_level(9) == 2
    assert prior_accept(8, 2) == 0.9
    with pytest.raises(ValueError, match="max_match"):
        TrieConfidence(max_match=0)


def test_confidence_forgets_old_steps_once_a_bucket_is_full() -> None:
    """A bucket's counts are halved when its trials pass ``max_trials``: after a long run of
    hits, a run of misses moves the estimate down within about ``max_trials`` tests (without
    the cap it would stay near 1 for as many misses as there were hits)."""
    conf = TrieConfidence(max_match=4, prior_strength=2.0, max_trials=40.0)
    trie = AnnotatedTrie(tokens=[9, 5], parents=[-1, 0], match=[0, 3], support=[0, 1])
    for _ in range(1000):
        conf.observe(trie, [5, 1])
    assert conf.trials[3, 0] <= 40.0 and conf.accept_prob(3, 1) > 0.95
    for _ in range(60):
        conf.observe(trie, [4])
    assert conf.trials[3, 0] <= 40.0 and conf.accept_prob(3, 1) < 0.2
    assert 0.0 < conf.accept_prob(3, 1) < 1.0
    with pytest.raises(ValueError, match="max_trials"):
        TrieConfidence(prior_strength=8.0, max_trials=8.0)


def test_registered_with_an_eagle_head() -> None:
    assert "ngram_eagle" in drafter_names()
    info = drafter_info("ngram_eagle")
    assert info.eagle_head and info.needs_draft_model and info.expands_tree


class _StubEagle:
    """What :class:`NgramEagleDrafter` reads of an EAGLE drafter: a fixed chain tree of
    ``depth`` drafts (tokens 101, 102, ...) per request, cut to a sized propose's budget."""

    def __init__(self, num_nodes: int, depth: int) -> None:
        self.num_nodes, self.depth = num_nodes, depth
        self.device, self.staging = torch.device("cpu"), None
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.last_node_scores: torch.Tensor | None = None
        self.calls: list[int | None] = []

    def _tree(self, reqs: list[DraftRequest], real: int) -> VerifyTree:
        n = self.num_nodes
        toks = torch.full((len(reqs), n), -1, dtype=torch.int64)
        pars = torch.zeros((len(reqs), n), dtype=torch.int64)
        scores = torch.full((len(reqs), n), float("-inf"))
        for b, r in enumerate(reqs):
            toks[b, 0], pars[b, 0], scores[b, 0] = r.token_ids[-1], -1, 0.0
            for i in range(1, real + 1):
                toks[b, i], pars[b, i], scores[b, i] = 100 + i, i - 1, -0.01 * i
        self.last_node_scores = scores
        return VerifyTree.from_parents(toks, pars)

    def propose(self, reqs: list[DraftRequest]) -> VerifyTree:
        self.calls.append(None)
        return self._tree(reqs, min(self.depth, self.num_nodes - 1))

    def propose_sized(self, reqs: list[DraftRequest], max_nodes: int) -> VerifyTree:
        self.calls.append(max_nodes)
        return self._tree(reqs, min(self.depth, max_nodes - 1))


def test_sized_propose_runs_the_sized_eagle_propose_and_keeps_the_best_first() -> None:
    # The adaptive sizer's small trees (a 2-node probe) must not pay EAGLE's full expansion:
    # the sized propose asks EAGLE for a sized tree, and the merged tree's first max_nodes
    # columns (what the verify keeps) are a tree of the best nodes.
    spec = SpecConfig(algorithm="ngram_eagle", num_draft_tokens=6)
    eagle = _StubEagle(6, depth=4)
    drafter = NgramEagleDrafter(spec, ngram=NgramDrafter(spec), eagle=eagle)  # type: ignore[arg-type]
    hist = [7, 8, 9, 7, 8]  # the trie: 9 -> 7 -> 8 (a 2-token match)
    reqs = [DraftRequest("a", hist, len(hist) - 1)]
    full = drafter.propose(reqs)
    sized = drafter.propose_sized(reqs, 2)
    assert eagle.calls == [None, 2]
    assert full.draft_tokens.shape == sized.draft_tokens.shape == (1, 6)
    # EAGLE's chain scores above the trie's guess: its first draft leads both trees
    assert full.draft_tokens[0, :2].tolist() == sized.draft_tokens[0, :2].tolist() == [8, 101]
    assert sized.parents[0, 1].item() == 0
    # the sized EAGLE tree had one draft: the trie fills the rest
    assert 102 not in sized.draft_tokens[0].tolist() and 9 in sized.draft_tokens[0].tolist()
