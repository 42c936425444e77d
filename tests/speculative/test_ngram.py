"""N-gram drafter: continuations and trie construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import DraftRequest
from structspec.speculative.ngram import (
    NgramDrafter,
    continuation_starts,
    continuation_starts_batch,
    find_continuations,
)


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


def _batch_as_lists(histories: list[np.ndarray], **kw: int) -> list[list[int]]:
    starts, offsets = continuation_starts_batch(histories, **kw)
    assert starts.dtype == np.int64 and offsets.dtype == np.int64
    assert offsets.shape == (len(histories) + 1,) and offsets[-1] == len(starts)
    return [starts[offsets[b]: offsets[b + 1]].tolist() for b in range(len(histories))]


def test_batch_matching_stays_inside_each_request() -> None:
    # Request 1's candidate end 0 would match 2 tokens if the lookback read request 0's 9.
    hists = [np.array([4, 9]), np.array([3, 9, 3]), np.array([], dtype=np.int64), np.array([3])]
    assert _batch_as_lists(hists, min_window=2, max_window=4) == [[], [], [], []]
    assert _batch_as_lists(hists, min_window=1, max_window=4) == [[], [1], [], []]
    assert _batch_as_lists([], min_window=1, max_window=4) == []
    assert _batch_as_lists([np.array([7])], min_window=1, max_window=4) == [[]]


def test_batch_starts_equal_per_request_starts() -> None:
    """Same candidates, order and cap as :func:`continuation_starts` on each history alone."""
    rng = np.random.default_rng(7)
    checked = nonempty = 0
    for trial in range(400):
        bsz = int(rng.integers(0, 9))
        lo, hi = int(rng.integers(1, 5)), int(rng.integers(1, 10))
        cap = int(rng.choice([1, 2, 3, 16]))
        vocab = int(rng.integers(1, 5))  # few symbols: many (long) matches
        lens = rng.choice([0, 1, 2, 3, hi, hi + 1, int(rng.integers(4, 80))], size=bsz)
        dtype = np.int32 if trial % 5 == 0 else np.int64
        hists = [rng.integers(0, vocab, size=int(n)).astype(dtype) for n in lens]
        got = _batch_as_lists(hists, min_window=lo, max_window=hi, max_candidates=cap)
        want = [continuation_starts(h.astype(np.int64), min_window=lo, max_window=hi,
                                    max_candidates=cap).tolist() for h in hists]
        assert got == want, (trial, lens.tolist(), lo, hi, cap)
        checked += bsz
        nonempty += sum(map(bool, want))
    assert checked > 1000 and nonempty > 300  # the comparison saw real candidates


def test_batch_starts_large_batch() -> None:
    """Past the 16-bit sort key (``B * (max_window + 1) >= 2**15``) the order still holds."""
    rng = np.random.default_rng(3)
    hists = [rng.integers(0, 3, size=int(n)) for n in rng.integers(0, 12, size=4000)]
    want = [continuation_starts(h, min_window=1, max_window=8, max_candidates=2).tolist()
            for h in hists]
    assert _batch_as_lists(hists, min_window=1, max_window=8, max_candidates=2) == want
    with pytest.raises(ValueError, match="max_window"):
        continuation_starts_batch(hists, min_window=1, max_window=0)

def _reference_tree(drafter: NgramDrafter, reqs: list[DraftRequest]) -> VerifyTree:
    """Per-request :meth:`NgramDrafter.build_tree`, padded to ``[B, N]`` (token -1, parent 0)."""
    n = drafter.num_nodes
    tokens = np.full((len(reqs), n), -1, dtype=np.int64)
    parents = np.zeros((len(reqs), n), dtype=np.int64)
    for b, req in enumerate(reqs):
        toks, pars = drafter.build_tree(req.token_ids)
        tokens[b, : len(toks)] = toks
        parents[b, : len(pars)] = pars
    return VerifyTree.from_parents(torch.from_numpy(tokens), torch.from_numpy(parents))


def test_propose_equals_per_request_build_tree() -> None:
    rng = np.random.default_rng(11)
    drafts = chains = 0
    for trial in range(60):
        spec = SpecConfig(algorithm="ngram", num_draft_tokens=int(rng.integers(2, 12)),
                          ngram_min_window=int(rng.integers(1, 4)),
                          ngram_max_window=int(rng.integers(3, 10)),
                          ngram_branch_length=int(rng.integers(1, 14)))
        drafter = NgramDrafter(spec)
        bsz = int(rng.integers(0, 10))
        ids = [rng.integers(0, 5, size=int(rng.choice([1, 2, 5, 40, 200]))).tolist()
               for _ in range(bsz)]
        for _ in range(3):  # the same requests growing over steps (history cache in use)
            reqs = [DraftRequest(f"r{b}", h, len(h)) for b, h in enumerate(ids)]
            got, want = drafter.propose(reqs), _reference_tree(drafter, reqs)
            assert got.draft_tokens.shape == (bsz, drafter.num_nodes)
            for field in ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                          "ancestor_mask"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (trial, field)
            drafts += int((want.draft_tokens[:, 1:] >= 0).sum())
            full = (want.draft_tokens >= 0).all(dim=1)  # the chain fast path's trees
            chains += int((full & (want.parents == torch.arange(-1, drafter.num_nodes - 1))
                           .all(dim=1)).sum())
            ids = [h + rng.integers(0, 5, size=int(rng.integers(0, 4))).tolist() for h in ids]
    assert drafts > 1000  # most trees had drafts, not only roots
    assert chains > 50  # full single-chain trees (propose's slice-copy path) were compared
