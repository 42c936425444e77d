"""N-gram drafter: continuations and trie construction."""

from __future__ import annotations

import numpy as np

from structspec.config import SpecConfig
from structspec.spec.base import DraftRequest
from structspec.spec.ngram import NgramDrafter, find_continuations


def test_longest_match_first_then_recent() -> None:
    hist = np.array([1, 2, 3, 9, 2, 3, 8, 5, 2, 3])
    conts = find_continuations(hist, min_window=1, max_window=4, branch_length=3)
    # suffix [2, 3] matches at ends 2 and 5 (len 2); [1,2,3] vs [5,2,3]: no len-3 match.
    # Same length -> most recent first: end 5 -> [8, 5, 2]; end 2 -> [9, 2, 3].
    assert conts[0].tolist() == [8, 5, 2]
    assert conts[1].tolist() == [9, 2, 3]


def test_min_window_filters() -> None:
    hist = np.array([4, 7, 1, 5, 7])
    assert find_continuations(hist, min_window=2, max_window=4, branch_length=3) == []
    assert find_continuations(hist, min_window=1, max_window=4, branch_length=3)[0].tolist() == [1, 5, 7]


def test_tree_merges_shared_prefixes_and_respects_budget() -> None:
    drafter = NgramDrafter(SpecConfig(algorithm="ngram", num_draft_tokens=5, ngram_branch_length=3))
    toks, pars = drafter.build_tree([7, 1, 2, 3, 7, 1, 2, 4, 7])
    assert toks[0] == 7 and pars[0] == -1
    assert len(toks) <= 5
    # Most recent continuation [1, 2, 4] forms a chain, the older [1, 2, 3] branches at depth 3.
    assert toks[1:4] == [1, 2, 4] and pars[1:4] == [0, 1, 2]
    assert toks[4] == 3 and pars[4] == 2
    tree = drafter.propose([DraftRequest("a", [7, 1, 2, 3, 7, 1, 2, 4, 7], 8),
                            DraftRequest("b", [5], 0)])
    assert tree.draft_tokens.shape == (2, 5)
    assert tree.draft_tokens[1].tolist() == [5, -1, -1, -1, -1]


def _continuations_reference(history: np.ndarray, min_window: int, max_window: int,
                             branch_length: int) -> list[list[int]]:
    """Plain-Python prompt lookup: match length of every earlier end, longest then latest."""
    n = len(history)
    found = []
    for e in range(n - 1):
        k = 0
        while k < max_window and e - k >= 0 and history[e - k] == history[n - 1 - k] \
                and n - 1 - k > e - k:
            k += 1
        if k >= max(min_window, 1):
            found.append((-k, -e))
    found.sort()
    return [history[-e + 1: -e + 1 + branch_length].tolist() for _, e in found[:16]
            if -e + 1 < n]


def test_vectorised_matching_equals_reference() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        hist = rng.integers(0, 4, size=n).astype(np.int64)  # few symbols: many matches
        lo, hi = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        got = [c.tolist() for c in find_continuations(
            hist, min_window=lo, max_window=hi, branch_length=5)]
        assert got == _continuations_reference(hist, lo, hi, 5)


def test_history_cache_follows_appends_and_cuts() -> None:
    d = NgramDrafter(SpecConfig(algorithm="ngram", num_draft_tokens=6))
    ids = [1, 2, 3, 1, 2]
    first = d.propose([DraftRequest("a", ids, len(ids))])
    ids2 = ids + [3, 1, 2]
    again = d.propose([DraftRequest("a", ids2, len(ids2))])
    fresh = NgramDrafter(SpecConfig(algorithm="ngram", num_draft_tokens=6)).propose(
        [DraftRequest("b", ids2, len(ids2))])
    assert np.array_equal(again.draft_tokens.numpy(), fresh.draft_tokens.numpy())
    cut = d.propose([DraftRequest("a", ids, len(ids))])  # shorter: rebuilt, same as before
    assert np.array_equal(cut.draft_tokens.numpy(), first.draft_tokens.numpy())
