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


def continuation_starts(
    history: np.ndarray, *, min_window: int, max_window: int, max_candidates: int = 16,
) -> np.ndarray:
    """Start positions of the continuations of earlier occurrences of the history's suffix,
    best first (see :func:`find_continuations`).

    Every earlier position ``e`` holding the last token is a candidate; its match length is
    how many tokens, read backwards from ``e`` and from the end, agree (at most
    ``max_window``). All candidates are compared at once as one ``[E, w]`` gather, so the
    cost does not grow with ``max_window`` (a per-``k`` loop or a sliding-window view costs
    ~5x more in numpy call overhead at these sizes).

    Args:
        history: ``[L]`` int64 token ids; ``history[-1]`` is the last committed token.

    Returns:
        ``int64 [C]`` (``C <= max_candidates``): ``e + 1`` per kept candidate, ordered by match
        length (longest first) then recency (latest first).
    """
    n = len(history)
    if n < 2:
        return np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(history[:-1] == history[-1])  # candidate match ends
    if ends.size == 0:
        return ends
    w = min(max_window, n - 1)
    back = np.arange(w)
    src = ends[:, None] - back  # [E, w]: positions k tokens back from each candidate end
    same = (history[src.clip(min=0)] == history[n - 1 - back]) & (src >= 0)
    match_len = np.where(same.all(axis=1), w, same.argmin(axis=1))
    keep = match_len >= min_window
    ends, match_len = ends[keep], match_len[keep]
    order = np.lexsort((-ends, -match_len))[:max_candidates]
    return ends[order] + 1


def find_continuations(
    history: np.ndarray, *, min_window: int, max_window: int, branch_length: int,
    max_candidates: int = 16,
) -> list[np.ndarray]:
    """Continuations of earlier occurrences of the history's suffix, best first.

    Args:
        history: ``[L]`` int64 token ids; ``history[-1]`` is the last committed token.

    Returns:
        Up to ``max_candidates`` arrays of following tokens (at most ``branch_length`` each),
        ordered by match length (longest first) then recency (latest first).
    """
    starts = continuation_starts(history, min_window=min_window, max_window=max_window,
                                 max_candidates=max_candidates)
    return [history[s: s + branch_length] for s in starts.tolist()]


class _History:
    """A request's token ids as a growing numpy buffer (appends are amortised O(1))."""

    __slots__ = ("buf", "length")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.buf = np.asarray(token_ids, dtype=np.int64)
        self.length = len(self.buf)

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """Bring the buffer up to ``token_ids`` (append the new tail) and return a view.

        Tokens are only ever appended while a request runs; a shorter or diverging list (a
        stop cut the output) rebuilds the buffer.
        """
        n = len(token_ids)
        if n < self.length or (self.length and int(self.buf[self.length - 1])
                               != token_ids[self.length - 1]):
            self.__init__(token_ids)  # type: ignore[misc]
        elif n > self.length:
            if n > len(self.buf):
                grown = np.empty(max(2 * len(self.buf), n), dtype=np.int64)
                grown[: self.length] = self.buf[: self.length]
                self.buf = grown
            self.buf[self.length:n] = token_ids[self.length:n]
            self.length = n
        return self.buf[: self.length]


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
        self._histories: dict[str, _History] = {}

    def build_tree(self, token_ids: Sequence[int] | np.ndarray) -> tuple[list[int], list[int]]:
        """Tokens and parents (node 0 first) of one request's tree, at most ``num_nodes``."""
        history = np.asarray(token_ids, dtype=np.int64)
        tokens = [int(history[-1])]
        parents = [-1]
        children: list[dict[int, int]] = [{}]
        budget = self.num_nodes - 1
        starts = continuation_starts(history, min_window=self.min_window,
                                     max_window=self.max_window)
        for start in starts.tolist():  # sliced lazily: the tree usually fills from 1-2
            node = 0
            for tok in history[start: start + self.branch_length].tolist():
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
        tokens = np.full((len(reqs), n), -1, dtype=np.int64)
        parents = np.zeros((len(reqs), n), dtype=np.int64)
        for b, req in enumerate(reqs):
            hist = self._histories.get(req.request_id)
            if hist is None:
                hist = self._histories[req.request_id] = _History(req.token_ids)
            toks, pars = self.build_tree(hist.sync(req.token_ids))
            tokens[b, : len(toks)] = toks
            parents[b, : len(pars)] = pars
        return VerifyTree.from_parents(torch.from_numpy(tokens), torch.from_numpy(parents))

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
