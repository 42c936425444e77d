"""One verify tree from two drafters' trees: the best ``N - 1`` nodes of an n-gram trie and an
EAGLE tree together, ranked by one score, merged where both propose the same path.

Every node of both trees carries a score, a cumulative log-probability that the target accepts
its whole path: EAGLE's are its EAGLE-2 scores (the head's draft log-probabilities summed along
the path), the trie's come from the n-gram branch's per-step confidence
(:class:`~structspec.speculative.ngram_confidence.TrieConfidence`: the estimated acceptance of
each trie node from the suffix match that proposed it, summed along the path). The two trees
are merged as a trie union: an EAGLE node whose token path equals a trie node's path *is* that
node (a duplicate: one verify row, scored by the better of its two scores, its EAGLE children
hang under the trie node); every other EAGLE node is *new*. Of the trie's nodes and the new
EAGLE nodes the ``N - 1`` best-scored are kept, laid out in rank order after the root.

Why one ranking: with greedy verification, adding a node to a tree never shortens the accepted
path, so the only question per slot is which source's next node is more likely to be accepted.
A trie from a long suffix match (copied text) scores near 0 and keeps all its nodes; a trie
from a 1-2 token match (a guess) scores low past its first depth, and EAGLE's likelier nodes
take those slots; a trie that leaves slots free leaves them to EAGLE at any confidence.

A child never scores above its parent in either tree (log-probabilities are ``<= 0``), a
duplicate's parent is a duplicate too (the trees are prefix-closed), and ties rank by candidate
index (trie nodes first, each tree's parents before its children), so the kept set is closed
under ancestors and rank order puts parents before children: the result is a tree, and so is
any prefix of it (:func:`~structspec.scheduler.tree_fit.fit_trees` relies on that), the best
nodes first.

Device ops only, no host sync (the EAGLE tree stays where it was drafted); the duplicate search
runs ``max_depth`` times (the EAGLE expansion depth), not once per node.
"""

from __future__ import annotations

import torch

from structspec.kernels import index_kernels_usable
from structspec.speculative.expansion import rank_order

#: largest tree the Triton merge takes (kernels/tree_union.py imports triton: not here)
UNION_MAX_NODES = 64


def union_trees(
    ngram_tokens: torch.Tensor,
    ngram_parents: torch.Tensor,
    ngram_scores: torch.Tensor,
    eagle_tokens: torch.Tensor,
    eagle_parents: torch.Tensor,
    eagle_depth: torch.Tensor,
    eagle_scores: torch.Tensor,
    *,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged tree's tokens and parents (see the module doc).

    Args:
        ngram_tokens: ``[B, N]`` int64, column 0 the root, then the trie's nodes, then
            padding (-1); every parent before its children.
        ngram_parents: ``[B, N]`` int64 parent node of each trie node (-1 for the root, 0 for
            padding).
        ngram_scores: ``[B, N]`` float32 cumulative log-probability of each trie node (``<=``
            its parent's; padding and the root are ignored).
        eagle_tokens: ``[B, N]`` int64 EAGLE tree (:class:`~structspec.draft_tree.layout.
            VerifyTree` ``draft_tokens``; -1 padding).
        eagle_parents: ``[B, N]`` int64 its parents.
        eagle_depth: ``[B, N]`` int64 its depths.
        eagle_scores: ``[B, N]`` float32 EAGLE-2 score of each EAGLE node (``<=`` its
            parent's; NaN and ``-inf`` rank last among the real nodes).
        max_depth: the deepest EAGLE node (the expansion's ``depth``).

    All on one device. Column 0 of both trees is the same root token.

    Returns:
        ``(tokens [B, N], parents [B, N])`` int64 on that device: the root, then the kept
        nodes best first, then padding (-1 token, parent 0); parents precede children. Feed
        them to :meth:`~structspec.draft_tree.layout.VerifyTree.from_parents`.

    Integer trees of any width and floating scores of any precision are promoted to int64 /
    float32 first (no copies for the drafter's own inputs).

    Raises:
        ValueError: ``ngram_tokens`` not ``[B, N]`` with ``N >= 1``, the inputs differ in
            shape, or ``max_depth`` below 0.
    """
    if ngram_tokens.dim() != 2 or ngram_tokens.shape[1] < 1:
        raise ValueError(f"ngram_tokens {tuple(ngram_tokens.shape)}: expected [B, N], N >= 1")
    if max_depth < 0:
        raise ValueError(f"max_depth={max_depth}: expected >= 0")
    shape = ngram_tokens.shape
    for name, t in (("ngram_parents", ngram_parents), ("ngram_scores", ngram_scores),
                    ("eagle_tokens", eagle_tokens), ("eagle_parents", eagle_parents),
                    ("eagle_depth", eagle_depth), ("eagle_scores", eagle_scores)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} differs from ngram_tokens "
                             f"{tuple(shape)}")
    ngram_tokens, ngram_parents, eagle_tokens, eagle_parents, eagle_depth = (
        t.long() for t in (ngram_tokens, ngram_parents, eagle_tokens, eagle_parents, eagle_depth))
    ngram_scores, eagle_scores = ngram_scores.float(), eagle_scores.float()
    bsz, n = shape
    if index_kernels_usable(ngram_tokens) and n <= UNION_MAX_NODES:
        # one launch where the ops below are ~130 (kernels/tree_union.py; equal results for
        # the drafter's inputs, whose trie scores are finite)
        from structspec.kernels.tree_union import union_trees_kernel

        return union_trees_kernel(ngram_tokens, ngram_parents, ngram_scores, eagle_tokens,
                                  eagle_parents, eagle_depth, eagle_scores, max_depth=max_depth)
    device = ngram_tokens.device
    neg_inf = torch.full((), float("-inf"), device=device)  # a fill, not a host copy
    g_real = ngram_tokens >= 0
    g_real[:, 0] = False  # the root is nobody's duplicate target
    e_real = eagle_tokens >= 0
    e_real[:, 0] = False
    e_par = eagle_parents.clamp(min=0)
    g_par = ngram_parents.clamp(min=0)
    # mapped[b, i]: the trie node EAGLE node i duplicates (0: the root), -1: none (yet).
    mapped = torch.full((bsz, n), -1, dtype=torch.int64, device=device)
    mapped[:, 0] = 0
    cols = torch.arange(n, device=device)
    same_token = (ngram_tokens.unsqueeze(1) == eagle_tokens.unsqueeze(2)) & g_real.unsqueeze(1)
    for depth in range(1, max_depth + 1):  # parents are mapped one level before children
        par_mapped = torch.gather(mapped, 1, e_par)  # [B, N]: -1 matches no trie parent
        match = same_token & (ngram_parents.unsqueeze(1) == par_mapped.unsqueeze(2))
        # at most one trie child per (parent, token): the index is the sum of the matches
        target = (match.long() * cols).sum(2)
        level = e_real & (eagle_depth == depth) & match.any(2)
        mapped = torch.where(level, target, mapped)
    dup = e_real & (mapped > 0)
    new = e_real & ~dup
    # Finite keys (real nodes with a -inf score still rank above padding, in index order).
    e_key = torch.nan_to_num(eagle_scores.float(), nan=float("-inf")).clamp(min=-1e30)
    g_key = torch.where(g_real, ngram_scores.float().clamp(min=-1e30), neg_inf)
    # a duplicate node takes the better of its two scores (scratch column n: not a duplicate)
    g_key = torch.cat([g_key, g_key.new_full((bsz, 1), float("-inf"))], 1)
    g_key.scatter_reduce_(1, torch.where(dup, mapped, n), torch.where(dup, e_key, neg_inf),
                          reduce="amax")
    g_key = g_key[:, :n]
    g_key[:, 0] = float("inf")  # the root ranks first
    # Candidates: the trie's columns 0..N-1, then the EAGLE tree's at N..2N-1 (new ones only).
    key = torch.cat([g_key, torch.where(new, e_key, neg_inf)], 1)  # [B, 2N]
    cand_tok = torch.cat([ngram_tokens, eagle_tokens], 1)
    e_cand_par = torch.where(torch.gather(dup, 1, e_par) | (e_par == 0),
                             torch.gather(mapped, 1, e_par).clamp(min=0), e_par + n)
    cand_par = torch.cat([g_par, e_cand_par], 1)
    valid = torch.cat([g_real, new], 1)
    valid[:, 0] = True
    c = 2 * n
    rank = torch.empty((bsz, c), dtype=torch.int64, device=device).scatter_(
        1, rank_order(torch.where(valid, key, neg_inf)),
        torch.arange(c, device=device).expand(bsz, c))
    keep = valid & (rank < n)
    dest = torch.where(keep, rank, n)  # column n: a discarded scratch
    parent = torch.gather(rank, 1, cand_par)
    tokens = ngram_tokens.new_full((bsz, n + 1), -1)
    parents = ngram_tokens.new_zeros((bsz, n + 1))
    tokens.scatter_(1, dest, torch.where(keep, cand_tok, -1))
    parents.scatter_(1, dest, torch.where(keep, parent, 0))
    tokens, parents = tokens[:, :n].contiguous(), parents[:, :n].contiguous()
    parents[:, 0] = -1
    return tokens, parents
