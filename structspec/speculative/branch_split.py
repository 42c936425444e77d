"""How many of a request's draft nodes the n-gram branch gets, from each branch's recent yield.

The ``ngram_eagle`` drafter (:mod:`structspec.speculative.ngram_eagle`) fills one verify tree
from two sources. Per request it keeps an EWMA of the accepted tokens each source delivered per
step; the n-gram branch gets the nodes in proportion to its share, rounded, with a floor of
``min_nodes`` for each source so that a source starved by a stretch of text it cannot predict
still proposes something and can win its share back. A new request starts at half and half.

Credit per step (host values only): along the committed run, the accepted drafts that lie on
the n-gram trie are the n-gram branch's (where both branches proposed the same path the merged
node counts for the n-gram branch: the EAGLE copy cost no row), the accepted drafts after the
trie ends are EAGLE's. A source that proposed nothing for a request this step (no earlier
match; EAGLE's features not there yet) learns nothing.

This splits a tree's nodes between sources; how many nodes each request's tree has is the tree
sizer's job (:mod:`structspec.scheduler.tree_sizing`), which sizes this drafter's trees like any
other's.
"""

from __future__ import annotations

from dataclasses import dataclass

#: EWMA weight of a step's credit (the tree sizer's acceptance EWMA uses the same weight)
SPLIT_EWMA_ALPHA = 0.3


@dataclass
class _Yield:
    """One request's EWMAs of accepted tokens per step, per source."""

    ngram: float
    eagle: float


class BranchSplit:
    """Per-request n-gram / EAGLE node split (see the module doc).

    Args:
        start: both sources' starting EWMA (equal: half and half).
        min_nodes: the floor of each source's nodes when the budget allows both.
        alpha: EWMA weight of a step's credit.

    Raises:
        ValueError: ``start <= 0``, ``min_nodes < 0`` or ``alpha`` outside ``(0, 1]``.
    """

    def __init__(self, *, start: float = 1.0, min_nodes: int = 1,
                 alpha: float = SPLIT_EWMA_ALPHA) -> None:
        if start <= 0:
            raise ValueError(f"start={start}: expected > 0")
        if min_nodes < 0:
            raise ValueError(f"min_nodes={min_nodes}: expected >= 0")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha}: expected 0 < alpha <= 1")
        self.start = start
        self.min_nodes = min_nodes
        self.alpha = alpha
        self._reqs: dict[str, _Yield] = {}

    def _state(self, request_id: str) -> _Yield:
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _Yield(self.start, self.start)
        return st

    def share(self, request_id: str) -> float:
        """The n-gram branch's share of the request's draft nodes, in [0, 1] (0.5 when both
        EWMAs are ~0: nothing tells them apart)."""
        st = self._state(request_id)
        total = st.ngram + st.eagle
        return 0.5 if total < 1e-6 else st.ngram / total

    def ngram_nodes(self, request_id: str, drafts: int) -> int:
        """Draft nodes (root excluded) the n-gram branch gets out of ``drafts``: the rounded
        share, at least ``min_nodes`` for each source when ``drafts >= 2 * min_nodes``
        (with fewer, the source with the larger share takes them)."""
        if drafts <= 0:
            return 0
        share = self.share(request_id)
        floor = self.min_nodes
        if drafts < 2 * floor:
            return drafts if share >= 0.5 else 0
        return min(max(round(share * drafts), floor), drafts - floor)

    def observe(self, request_id: str, ngram_tokens: int | None,
                eagle_tokens: int | None) -> None:
        """One step's credit: accepted tokens from each source, None for a source that
        proposed nothing for the request this step (its EWMA is left as it was)."""
        st = self._state(request_id)
        a = self.alpha
        if ngram_tokens is not None:
            st.ngram += a * (ngram_tokens - st.ngram)
        if eagle_tokens is not None:
            st.eagle += a * (eagle_tokens - st.eagle)

    def release(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are ignored)."""
        self._reqs.pop(request_id, None)

    def num_tracked(self) -> int:
        """Requests with a split state (tests)."""
        return len(self._reqs)


def ngram_credit(trie_tokens: list[int], trie_parents: list[int], accepted: list[int]) -> int:
    """How many of ``accepted`` (the accepted drafts of one step, in order) lie on the n-gram
    trie: the length of the longest prefix that is a path from its root.

    Args:
        trie_tokens: the trie's tokens, node 0 (the root) first.
        trie_parents: each node's parent (-1 for the root); parents before children.
        accepted: the step's accepted draft tokens (the bonus token excluded).
    """
    node, depth = 0, 0
    for tok in accepted:
        nxt = -1
        for j in range(node + 1, len(trie_tokens)):  # a child comes after its parent
            if trie_parents[j] == node and trie_tokens[j] == tok:
                nxt = j
                break
        if nxt < 0:
            break
        node, depth = nxt, depth + 1
    return depth
