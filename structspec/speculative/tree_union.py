"""One verify tree from two drafters' trees: an n-gram trie plus the best EAGLE nodes that fill
the rest of the node budget, merged where both propose the same path.

The n-gram drafter's trie (host lists, staged to the device) keeps its nodes and its layout:
nodes ``1..G`` of the result. The EAGLE tree (on the device, from its propose graph or the
eager expansion) is merged in as a trie union: an EAGLE node whose token path equals an n-gram
node's path *is* that node (a duplicate: it costs no verify row, and its EAGLE children hang
under the n-gram node), every other EAGLE node is *new*. The ``N - 1 - G`` free slots go to the
new EAGLE nodes with the best EAGLE-2 scores (cumulative draft log-probability); a child never
scores above its parent and comes after it in the EAGLE layout, so the kept set is closed
under ancestors and the result is a tree. Kept EAGLE nodes follow the n-gram nodes in their
EAGLE order (parents before children everywhere, so any prefix of the nodes is a tree too,
which :func:`~structspec.scheduler.tree_fit.fit_trees` relies on).

Device ops only, no host sync (the EAGLE tree stays where it was drafted); the loop runs
``max_depth`` times (the EAGLE expansion depth), not once per node.
"""

from __future__ import annotations

import torch

from structspec.speculative.expansion import rank_order


def union_trees(
    ngram_tokens: torch.Tensor,
    ngram_parents: torch.Tensor,
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
        eagle_tokens: ``[B, N]`` int64 EAGLE tree (:class:`~structspec.draft_tree.layout.
            VerifyTree` ``draft_tokens``; -1 padding).
        eagle_parents: ``[B, N]`` int64 its parents.
        eagle_depth: ``[B, N]`` int64 its depths.
        eagle_scores: ``[B, N]`` float32 EAGLE-2 score of each EAGLE node (``<=`` its
            parent's; NaN and ``-inf`` rank last).
        max_depth: the deepest EAGLE node (the expansion's ``depth``).

    All on one device. Column 0 of both trees is the same root token.

    Returns:
        ``(tokens [B, N], parents [B, N])`` int64 on that device: the root, the n-gram nodes at
        their own columns, then the kept new EAGLE nodes, then padding (-1 token, parent 0);
        parents precede children. Feed them to
        :meth:`~structspec.draft_tree.layout.VerifyTree.from_parents`.

    Raises:
        ValueError: the four ``[B, N]`` inputs differ in shape.
    """
    shape = ngram_tokens.shape
    for name, t in (("ngram_parents", ngram_parents), ("eagle_tokens", eagle_tokens),
                    ("eagle_parents", eagle_parents), ("eagle_depth", eagle_depth),
                    ("eagle_scores", eagle_scores)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} differs from ngram_tokens "
                             f"{tuple(shape)}")
    bsz, n = shape
    device = ngram_tokens.device
    cols = torch.arange(n, device=device)
    g_real = ngram_tokens >= 0
    g_real[:, 0] = False  # the root is nobody's duplicate target
    e_real = eagle_tokens >= 0
    e_real[:, 0] = False
    e_par = eagle_parents.clamp(min=0)
    # mapped[b, i]: the n-gram node EAGLE node i duplicates (0: the root), -1: none (yet).
    mapped = torch.full((bsz, n), -1, dtype=torch.int64, device=device)
    mapped[:, 0] = 0
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
    free = (n - 1) - g_real.sum(1, keepdim=True)  # [B, 1] slots left after the trie
    key = torch.where(new, torch.nan_to_num(eagle_scores.float(), nan=float("-inf"))
                      .clamp(min=-1e30), torch.full_like(eagle_scores, float("-inf"),
                                                         dtype=torch.float32))
    rank = torch.empty_like(mapped).scatter_(1, rank_order(key), cols.expand(bsz, n))
    keep = new & (rank < free)
    pos = g_real.sum(1, keepdim=True) + torch.cumsum(keep.long(), 1)  # column of a kept node
    par_dup = torch.gather(dup, 1, e_par)
    parent = torch.where(e_par == 0, torch.zeros_like(e_par),
                         torch.where(par_dup, torch.gather(mapped, 1, e_par),
                                     torch.gather(pos, 1, e_par)))
    dest = torch.where(keep, pos, torch.full_like(pos, n))  # column n: a discarded scratch
    tokens = torch.cat([ngram_tokens, ngram_tokens.new_full((bsz, 1), -1)], 1)
    parents = torch.cat([ngram_parents.clamp(min=0), ngram_parents.new_zeros((bsz, 1))], 1)
    tokens.scatter_(1, dest, torch.where(keep, eagle_tokens, -1))
    parents.scatter_(1, dest, torch.where(keep, parent, 0))
    tokens, parents = tokens[:, :n].contiguous(), parents[:, :n].contiguous()
    parents[:, 0] = -1
    return tokens, parents
