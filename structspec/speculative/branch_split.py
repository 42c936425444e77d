"""How many of a request's draft nodes the n-gram branch gets, from each branch's recent yield.

The ``ngram_eagle`` drafter (:mod:`structspec.speculative.ngram_eagle`) fills one verify tree
from two sources. Per request it keeps an EWMA of the accepted tokens each source delivered per
step; the n-gram branch gets the rounded share ``ngram / (ngram + eagle)`` of the nodes and
EAGLE the rest (EAGLE also takes whatever the n-gram trie leaves unused). A new request starts
from the engine's running averages; before any step from ``start_ngram`` / ``start_eagle``
(the drafter starts the n-gram branch at a full trie: a trie with no earlier match is empty,
so its nodes go to EAGLE anyway, and one with a match is usually right at first on copied
text, where a slow start costs most).

Credit per step (host values only):

* **n-gram**: the accepted run (bonus token included) read along the n-gram drafter's *full*
  trie, the one it would have proposed with every node: how far it would have gone. It is
  built on the host anyway (the proposed trie is its first nodes), so the n-gram branch is
  measured even in steps where it got no node and needs no floor to recover.
* **EAGLE**: the accepted drafts after the proposed trie ends (where both branches proposed the
  same path the merged node counts for the n-gram branch: the EAGLE copy cost no row). Its tree
  is on the device, so EAGLE is only measured through nodes it gets: a request whose share
  rounds EAGLE down to 0 nodes gets one EAGLE node every ``probe_every`` steps (a probe, as the
  tree sizer re-probes requests that stopped drafting: the floor of one node, paid only on
  probe steps); a probe that is accepted resets the interval, one that is not doubles it (up to
  ``max_probe_every``).

A source that proposed nothing for a request this step (EAGLE's features not there yet) learns
nothing. This splits a tree's nodes between sources; how many nodes each request's tree has is
the tree sizer's job (:mod:`structspec.scheduler.tree_sizing`), which sizes this drafter's trees
like any other's.
"""

from __future__ import annotations

from dataclasses import dataclass

#: EWMA weight of a step's credit (heavier than the tree sizer's 0.3: a request's text switches
#: between copied and generated spans within a few steps)
SPLIT_EWMA_ALPHA = 0.5
#: EWMA weight of a step's credit in the engine-wide averages new requests start from
ENGINE_EWMA_ALPHA = 0.05


@dataclass
class _Yield:
    """One request's EWMAs of accepted tokens per step, per source, and its EAGLE probes."""

    ngram: float
    eagle: float
    idle_steps: int = 0  # consecutive steps EAGLE got no node by its share
    probe_every: int = 0  # 0: the default interval
    probing: bool = False  # this step's EAGLE node is a probe


class BranchSplit:
    """Per-request n-gram / EAGLE node split (see the module doc).

    Args:
        start_ngram, start_eagle: each source's EWMA before any step (equal: half and half).
        alpha: EWMA weight of a step's credit per request.
        probe_every: steps between EAGLE probes while its share rounds to 0 nodes.
        max_probe_every: the interval's cap after failed probes (doubling).

    Raises:
        ValueError: a start ``<= 0``, ``alpha`` outside ``(0, 1]`` or ``probe_every < 1``.
    """

    def __init__(self, *, start_ngram: float = 1.0, start_eagle: float = 1.0,
                 alpha: float = SPLIT_EWMA_ALPHA, probe_every: int = 8,
                 max_probe_every: int = 64) -> None:
        if start_ngram <= 0 or start_eagle <= 0:
            raise ValueError(f"start_ngram={start_ngram}, start_eagle={start_eagle}: "
                             "expected > 0")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha}: expected 0 < alpha <= 1")
        if probe_every < 1:
            raise ValueError(f"probe_every={probe_every}: expected >= 1")
        self.alpha = alpha
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        #: engine-wide EWMAs of each source's credit (a new request's starting point)
        self.engine_ngram = start_ngram
        self.engine_eagle = start_eagle
        self._reqs: dict[str, _Yield] = {}

    def _state(self, request_id: str) -> _Yield:
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _Yield(self.engine_ngram, self.engine_eagle)
        return st

    def share(self, request_id: str) -> float:
        """The n-gram branch's share of the request's draft nodes, in [0, 1] (0.5 when both
        EWMAs are ~0: nothing tells them apart)."""
        st = self._state(request_id)
        total = st.ngram + st.eagle
        return 0.5 if total < 1e-6 else st.ngram / total

    def ngram_nodes(self, request_id: str, drafts: int) -> int:
        """Draft nodes (root excluded) the n-gram branch gets out of ``drafts`` this step:
        the rounded share; when that leaves EAGLE nothing, ``drafts - 1`` on EAGLE's probe
        steps (module doc). Call once per step and request drafted."""
        st = self._state(request_id)
        st.probing = False
        if drafts <= 0:
            return 0
        n = min(max(round(self.share(request_id) * drafts), 0), drafts)
        if n < drafts:
            st.idle_steps = 0
            return n
        st.idle_steps += 1
        if drafts >= 2 and st.idle_steps >= (st.probe_every or self.probe_every):
            st.idle_steps = 0
            st.probing = True
            return drafts - 1
        return drafts

    def observe(self, request_id: str, ngram_tokens: int | None,
                eagle_tokens: int | None) -> None:
        """One step's credit: accepted tokens of each source (module doc), None for a source
        that proposed nothing for the request this step (its EWMA is left as it was)."""
        st = self._state(request_id)
        a = self.alpha
        if ngram_tokens is not None:
            st.ngram += a * (ngram_tokens - st.ngram)
            self.engine_ngram += ENGINE_EWMA_ALPHA * (ngram_tokens - self.engine_ngram)
        if eagle_tokens is not None:
            st.eagle += a * (eagle_tokens - st.eagle)
            self.engine_eagle += ENGINE_EWMA_ALPHA * (eagle_tokens - self.engine_eagle)
            if st.probing:
                base = self.probe_every
                st.probe_every = base if eagle_tokens else min(
                    2 * (st.probe_every or base), self.max_probe_every)
        st.probing = False

    def release(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are ignored)."""
        self._reqs.pop(request_id, None)

    def num_tracked(self) -> int:
        """Requests with a split state (tests)."""
        return len(self._reqs)


def ngram_credit(trie_tokens: list[int], trie_parents: list[int], run: list[int]) -> int:
    """How many of ``run`` (tokens in commit order) lie on the n-gram trie: the length of the
    longest prefix that is a path from its root.

    Args:
        trie_tokens: the trie's tokens, node 0 (the root) first.
        trie_parents: each node's parent (-1 for the root); parents before children.
        run: the step's accepted drafts (for EAGLE's credit), or its whole committed run (the
            n-gram branch's own: the bonus token counts when the trie held it).
    """
    node, depth = 0, 0
    for tok in run:
        nxt = -1
        for j in range(node + 1, len(trie_tokens)):  # a child comes after its parent
            if trie_parents[j] == node and trie_tokens[j] == tok:
                nxt = j
                break
        if nxt < 0:
            break
        node, depth = nxt, depth + 1
    return depth
