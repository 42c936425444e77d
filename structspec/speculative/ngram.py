"""N-gram (prompt lookup) drafter: continue the text the way it continued before.

For each request, the last ``w`` tokens (``ngram_min_window <= w <= ngram_max_window``) are
looked up in the request's own prompt + output. Every earlier occurrence proposes the tokens
that followed it (up to ``ngram_branch_length``). Continuations are merged into a trie rooted at
node 0 in priority order (longest match first, then most recent), so shared prefixes share
nodes and divergent ones branch, until the tree has ``num_draft_tokens`` nodes. The idea is
prompt lookup decoding (Saxena, 2023) and sglang's n-gram tree drafter; the matching here is a
vectorised scan over the history (numpy), rebuilt each step, with no global corpus.

:meth:`NgramDrafter.propose` matches the whole batch at once
(:func:`continuation_starts_batch`: a constant number of numpy calls over the concatenated
histories), because per request the lookup is ~10 small numpy calls whose fixed overhead,
not the data, is the cost (~31 us a request on the H200 host, ~2 ms at batch 64). Only the
trie merge runs per request, in Python (:meth:`NgramDrafter.merge_continuations`, shared with
the single-request :meth:`NgramDrafter.build_tree`).

The tree is built on the host before the verify launch, so its grammar bitmask can be built
under the verify forward too (``supports_grammar_overlap``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.draft_tree.shape_layouts import ShapeLayouts
from structspec.speculative.base import Drafter, DraftRequest


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


def continuation_starts_batch(
    histories: Sequence[np.ndarray], *, min_window: int, max_window: int,
    max_candidates: int = 16,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`continuation_starts` for every request of a batch in one pass, as a CSR pair.

    Per request, :func:`continuation_starts` is ~10 numpy calls on a few hundred elements, so
    numpy's per-call overhead, not the data, is the cost (~31 us a request at ~900 tokens on
    the H200 host, ~2 ms at batch 64). Here all histories are matched together with a
    constant number of numpy calls, whatever the batch size (prompt lookup decoding, Saxena
    2023; sglang's n-gram tree drafter):

    1. ``flat`` = ``max_window - 1`` padding tokens (-1), then every history followed by one
       separator (-1). ``win`` is its ``[T, max_window]`` sliding-window view: row ``r`` is the
       window ending at padded position ``r + max_window - 1``, so rows index the unpadded
       layout (history tokens and separators).
    2. Candidate ends ``e``: positions holding their request's last token, except each
       request's final position itself.
    3. One ``[E, max_window]`` compare of the window ending at each candidate with the window
       ending at its request's final token. Reading backwards, the first position before the
       request's start is its separator (-1), which no token id equals, so a match never runs
       into the previous request. Match length = index of the first mismatch from the right,
       or ``max_window`` (a False sentinel column makes that one ``argmin``).
    4. Drop matches shorter than ``min_window``; order by ``(request, -match_len, -e)`` with
       one stable sort of a small integer key (``int16`` radix sort when it fits) over the
       reversed candidates, which are in ``e``-descending order already; keep the first
       ``max_candidates`` of each request (rank within its group).

    Each request's candidates, match lengths, order and cap are exactly those of
    :func:`continuation_starts` on that history alone (tested against it). A batch of one
    calls :func:`continuation_starts` directly (~10 calls instead of ~50).

    Args:
        histories: ``B`` arrays ``[L_b]`` of non-negative token ids (int64, or any integer
            dtype that casts to it); ``histories[b][-1]`` is request ``b``'s last committed
            token. Any ``L_b`` (0 and 1 give no candidates); ``B`` may be 0.
        min_window: shortest suffix match kept.
        max_window: longest suffix compared (match lengths are capped here); at least 1.
        max_candidates: most candidates kept per request.

    Returns:
        ``(starts, offsets)``: ``starts`` int64 ``[C]``, every request's candidates
        concatenated in request order, each ``e + 1`` relative to its own history (the first
        token of the continuation); ``offsets`` int64 ``[B + 1]`` with
        ``starts[offsets[b]:offsets[b + 1]]`` equal to ``continuation_starts(histories[b],
        ...)`` (at most ``max_candidates``, longest match first, then latest first).

    Raises:
        ValueError: when ``max_window < 1``.
    """
    if max_window < 1:
        raise ValueError(f"max_window={max_window}: must be >= 1")
    bsz = len(histories)
    offsets = np.zeros(bsz + 1, dtype=np.int64)
    if bsz == 1:  # one request: the single-request scan is fewer numpy calls
        starts = continuation_starts(np.asarray(histories[0], dtype=np.int64),
                                     min_window=min_window, max_window=max_window,
                                     max_candidates=max_candidates)
        offsets[1] = starts.size
        return starts, offsets
    lens = np.fromiter(map(len, histories), dtype=np.int64, count=bsz)
    if not lens.any():
        return np.empty(0, dtype=np.int64), offsets
    width = max_window
    sep = np.full(1, -1, dtype=np.int64)
    parts = [np.full(width - 1, -1, dtype=np.int64)]
    for hist in histories:
        parts += (hist, sep)
    flat = np.concatenate(parts, dtype=np.int64)  # [width - 1 + T]
    body = flat[width - 1:]  # [T] the layout: history b at rows begin[b]:end[b], separator
    end = np.cumsum(lens + 1)  # [B] row after each request's separator
    last = end - 2  # [B] row of each request's last token (empty: an earlier separator)
    last_tok = np.where(lens > 0, body[last], -2)  # -2: no token, no separator either
    cand = body == np.repeat(last_tok, lens + 1)  # [T]
    cand[last] = False  # a request's own last token is not an earlier occurrence
    ends = np.flatnonzero(cand)  # [E] rows, ascending, so grouped by request
    if ends.size == 0:
        return ends, offsets
    req = np.searchsorted(end, ends, side="right")  # [E] request of each candidate
    win = as_strided(flat, (body.size, width), (flat.itemsize,) * 2,
                     writeable=False)  # [T, width]: win[r] = body[r - width + 1 : r + 1]
    same = np.zeros((ends.size, width + 1), dtype=bool)  # column 0: always-False sentinel
    np.equal(win[ends], win[last[req]], out=same[:, 1:])  # [E, width], k = width - column
    match_len = same[:, ::-1].argmin(axis=1)  # [E] first mismatch reading backwards
    if min_window > 1:  # match_len >= 1 always: the end itself holds the last token
        keep = match_len >= min_window
        ends, req, match_len = ends[keep], req[keep], match_len[keep]
    # Stable sort of the reversed (latest-first) candidates by (request, longest match).
    key = (req * (width + 1) - match_len)[::-1]
    if bsz * (width + 1) < 2**15:
        key = key.astype(np.int16)  # numpy's stable sort is a radix sort for 16-bit keys
    order = np.argsort(key, kind="stable")
    ends, req = ends[::-1][order], req[::-1][order]
    counts = np.bincount(req, minlength=bsz)  # [B] candidates per request
    rank = np.arange(req.size) - (np.cumsum(counts) - counts)[req]  # index within request
    top = rank < max_candidates
    np.cumsum(np.minimum(counts, max_candidates), out=offsets[1:])
    begin = end - lens - 1  # [B] row of each request's first token
    return ends[top] - begin[req[top]] + 1, offsets


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
        # the trees' layouts per shape (chains and a few tries repeat every step)
        self._layouts = ShapeLayouts(self.num_nodes)

    def merge_continuations(
        self, history: np.ndarray, starts: Iterable[int],
    ) -> tuple[list[int], list[int]]:
        """Merge continuations into one request's trie, in priority order, until it is full.

        Args:
            history: ``[L]`` int64, ``L >= 1``: this request's own token ids (node 0 is
                ``history[-1]``).
            starts: continuation starts into ``history``, best first (from
                :func:`continuation_starts` or one request's slice of
                :func:`continuation_starts_batch`); each continuation is
                ``history[start : start + branch_length]``, so it never leaves the request.

        Returns:
            ``(tokens, parents)``: at most ``num_nodes`` each, node 0 first (parent -1), every
            parent before its children.
        """
        tokens = [int(history[-1])]
        parents = [-1]
        children: list[dict[int, int]] = [{}]
        budget = self.num_nodes - 1
        for start in starts:  # sliced lazily: the tree usually fills from 1-2
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

    def build_tree(self, token_ids: Sequence[int] | np.ndarray) -> tuple[list[int], list[int]]:
        """Tokens and parents (node 0 first) of one request's tree, at most ``num_nodes``.

        The single-request path (:func:`continuation_starts` then
        :meth:`merge_continuations`); :meth:`propose` builds the same trees batched.
        """
        history = np.asarray(token_ids, dtype=np.int64)
        starts = continuation_starts(history, min_window=self.min_window,
                                     max_window=self.max_window)
        return self.merge_continuations(history, starts.tolist())

    def sync_histories(self, reqs: Sequence[DraftRequest]) -> list[np.ndarray]:
        """Each request's cached history brought up to its ``token_ids``: ``B`` int64 views
        ``[L_b]`` (valid until the next sync)."""
        out = []
        for req in reqs:
            hist = self._histories.get(req.request_id)
            if hist is None:
                hist = self._histories[req.request_id] = _History(req.token_ids)
            out.append(hist.sync(req.token_ids))
        return out

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Host trees ``[B, num_nodes]`` for the batch: one batched lookup over all histories
        (:func:`continuation_starts_batch`), then per request either a slice copy (the best
        continuation alone fills the tree: a chain) or the trie merge; the same trees as
        :meth:`build_tree` on each request alone, laid out from per-shape tables
        (:class:`~structspec.draft_tree.shape_layouts.ShapeLayouts`: the layout
        :func:`~structspec.draft_tree.shape_layouts.pack_trees` computes, without its per-column
        passes over the batch)."""
        histories = self.sync_histories(reqs)
        starts, offsets = continuation_starts_batch(
            histories, min_window=self.min_window, max_window=self.max_window)
        n, bsz = self.num_nodes, len(histories)
        # Chain fast path: when the best continuation alone fills the budget, the trie is that
        # continuation's first n - 1 tokens in a chain (it is merged first, into an empty
        # trie, and the budget runs out inside it). On repetitive output (JSON) that is most
        # requests, and one slice replaces the dict walk of the merge.
        chain = [False] * bsz
        if n > 1 and self.branch_length >= n - 1 and starts.size:
            lens = np.fromiter(map(len, histories), dtype=np.int64, count=bsz)
            first = starts[np.minimum(offsets[:-1], starts.size - 1)]
            chain = ((offsets[1:] > offsets[:-1]) & (first + (n - 1) <= lens)).tolist()
        chain_parents = list(range(-1, n - 1))
        flat, off = starts.tolist(), offsets.tolist()
        trees = []
        for b, hist in enumerate(histories):
            if chain[b]:
                s = flat[off[b]]
                trees.append(([int(hist[-1]), *hist[s: s + n - 1].tolist()], chain_parents))
            else:
                trees.append(self.merge_continuations(hist, flat[off[b]: off[b + 1]]))
        return self._layouts.layout(trees)

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)


def create_ngram_drafter(spec: SpecConfig, **context: Any) -> NgramDrafter:
    """Registry factory of ``"ngram"`` (:mod:`structspec.speculative.registry`): reads only
    the ``ngram_*`` fields and ``num_draft_tokens`` of ``spec``; ``context`` is ignored."""
    return NgramDrafter(spec)
