"""N-gram (prompt lookup) drafter: continue the text the way it continued before.

For each request, the last ``w`` tokens (``ngram_min_window <= w <= ngram_max_window``) are
looked up in the request's own prompt + output. Every earlier occurrence proposes the tokens
that followed it (up to ``ngram_branch_length``). Continuations are merged into a trie rooted at
node 0 in priority order (longest match first, then most recent), so shared prefixes share
nodes and divergent ones branch, until the tree has ``num_draft_tokens`` nodes. The idea is
prompt lookup decoding (Saxena, 2023) and sglang's n-gram tree drafter; the matching here is a
vectorised scan over the history (numpy), rebuilt each step, with no global corpus.

The tree is built on the host before the verify launch, so its grammar bitmask can be built
under the verify forward too (``supports_grammar_overlap``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from structspec.config import SpecConfig
from structspec.spec.base import Drafter, DraftRequest
from structspec.spec.tree import VerifyTree


def find_continuations(
    history: np.ndarray, *, min_window: int, max_window: int, branch_length: int,
    max_candidates: int = 16,
) -> list[np.ndarray]:
    """Continuations of earlier occurrences of the history's suffix, best first.

    Args:
        history: ``[L]`` int64 token ids; ``history[-1]`` is the last committed token.

    Returns:
        Up to ``max_candidates`` arrays of following tokens, ordered by match length
        (longest first) then recency (latest first).
    """
    n = len(history)
    if n < 2:
        return []
    ends = np.nonzero(history[:-1] == history[-1])[0]  # candidate match ends (exclusive of last)
    if ends.size == 0:
        return []
    match_len = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, max_window):
        if n - 1 - k < 0:
            break
        src = ends - k
        ok = alive & (src >= 0)
        ok[ok] = history[src[ok]] == history[n - 1 - k]
        match_len += ok
        alive = ok
        if not alive.any():
            break
    keep = match_len >= min_window
    ends, match_len = ends[keep], match_len[keep]
    if ends.size == 0:
        return []
    order = np.lexsort((-ends, -match_len))[:max_candidates]
    return [history[e + 1 : e + 1 + branch_length] for e in ends[order] if e + 1 < n]


class NgramDrafter(Drafter):
    """Prompt-lookup drafter producing a trie-shaped verify tree on the host."""

    name = "ngram"
    tree_on_host = True
    supports_grammar_overlap = True

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec.num_draft_tokens)
        self.min_window = spec.ngram_min_window
        self.max_window = spec.ngram_max_window
        self.branch_length = spec.ngram_branch_length

    def build_tree(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Tokens and parents (node 0 first) of one request's tree, at most ``num_nodes``."""
        history = np.asarray(token_ids, dtype=np.int64)
        tokens = [int(history[-1])]
        parents = [-1]
        children: list[dict[int, int]] = [{}]
        budget = self.num_nodes - 1
        for cont in find_continuations(
            history, min_window=self.min_window, max_window=self.max_window,
            branch_length=self.branch_length,
        ):
            node = 0
            for tok in cont.tolist():
                nxt = children[node].get(tok)
                if nxt is None:
                    if budget == 0:
                        break
                    nxt = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    children.append({})
                    children[node][tok] = nxt
                    budget -= 1
                node = nxt
            if budget == 0:
                break
        return tokens, parents

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        n = self.num_nodes
        tokens = torch.full((len(reqs), n), -1, dtype=torch.int64)
        parents = torch.zeros((len(reqs), n), dtype=torch.int64)
        for b, req in enumerate(reqs):
            toks, pars = self.build_tree(req.token_ids)
            tokens[b, : len(toks)] = torch.tensor(toks)
            parents[b, : len(pars)] = torch.tensor(pars)
        return VerifyTree.from_parents(tokens, parents)
