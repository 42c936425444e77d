"""The ``ngram_eagle`` tree merge in one Triton launch.

:func:`~structspec.speculative.tree_union.union_trees` merges the n-gram trie and the EAGLE
tree of each request on the device in ~130 torch ops (a pass per expansion depth to map EAGLE
nodes onto trie paths, the duplicates' best scores, the ranking of both trees' nodes, the
scatter into rank order). Every step of a batch-1 ``ngram_eagle`` verify runs them after the
EAGLE propose graph, and their launches were most of its step on the H200 (6.9 ms per step
against ``eagle``'s 2.9, benchmarks/README.md, "Seventh H200 run"). :func:`union_trees_kernel`
computes the same tokens and parents, element for element, in one program per request:
comparisons, maxima and integer sums only (pairwise ``[N, N]`` tiles stand in for the gathers,
the sort and the scatters), so there is no rounding to differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structspec.kernels import tree_row_tiles

MAX_NODES = 64
"""Largest tree the kernel merges (``[N, N]`` tiles per program; larger trees keep the torch
path)."""

@triton.jit
def _union_kernel(
    GTok, GPar, GScore, ETok, EPar, EDepth, EScore, OutTok, OutPar, n,
    N_PAD: tl.constexpr, MAX_DEPTH: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, N_PAD)
    inb = idx < n
    base = b * n
    g_tok = tl.load(GTok + base + idx, mask=inb, other=-1)
    g_par = tl.load(GPar + base + idx, mask=inb, other=0)
    g_s = tl.load(GScore + base + idx, mask=inb, other=0.0)
    e_tok = tl.load(ETok + base + idx, mask=inb, other=-1)
    e_par = tl.load(EPar + base + idx, mask=inb, other=0)
    e_dep = tl.load(EDepth + base + idx, mask=inb, other=0)
    e_s = tl.load(EScore + base + idx, mask=inb, other=float("-inf"))
    g_real = (g_tok >= 0) & (idx > 0) & inb
    e_real = (e_tok >= 0) & (idx > 0) & inb
    e_par_c = tl.maximum(e_par, 0)
    g_par_c = tl.maximum(g_par, 0)
    row = idx[:, None]
    col = idx[None, :]
    # [i, j]: j is EAGLE node i's parent (the gather mapped[e_par[i]] as a masked sum)
    par_of = col == e_par_c[:, None]
    # [i, j]: trie node j holds EAGLE node i's token
    same_token = (g_tok[None, :] == e_tok[:, None]) & g_real[None, :]
    # mapped[i]: the trie node EAGLE node i duplicates (0: the root), -1: none
    mapped = tl.where(idx == 0, 0, -1).to(tl.int64)
    for depth in tl.static_range(1, MAX_DEPTH + 1):
        par_mapped = tl.sum(tl.where(par_of, mapped[None, :], 0), axis=1)
        match = same_token & (g_par[None, :] == par_mapped[:, None])
        target = tl.sum(tl.where(match, col, 0), axis=1).to(tl.int64)
        level = e_real & (e_dep == depth) & (tl.max(match.to(tl.int32), axis=1) > 0)
        mapped = tl.where(level, target, mapped)
    dup = e_real & (mapped > 0)
    new = e_real & ~dup
    # keys as the reference's nan_to_num(nan=-inf) (+inf -> FLT_MAX) then clamp(min=-1e30)
    e_key = tl.where(e_s == float("inf"), 3.4028234663852886e38, tl.maximum(e_s, -1e30))
    e_key = tl.where(e_s != e_s, -1e30, e_key)
    g_key = tl.where(g_real, tl.maximum(g_s, -1e30), float("-inf"))
    # a duplicated trie node takes the better of its score and its duplicates' (amax)
    dup_to = dup[:, None] & (mapped[:, None] == col)  # [i, j]: EAGLE i duplicates trie j
    best = tl.max(tl.where(dup_to, e_key[:, None], float("-inf")), axis=0)
    g_key = tl.maximum(g_key, best)
    g_key = tl.where(idx == 0, float("inf"), g_key)
    # ranking of the 2n candidates (trie j = candidate j, EAGLE i = candidate n + i) by key
    # descending, index ascending (every trie candidate precedes every EAGLE one in index)
    tk = tl.where(g_real | (idx == 0), g_key, float("-inf"))
    ek = tl.where(new, e_key, float("-inf"))
    in_col = inb[None, :]
    before_tt = ((tk[None, :] > tk[:, None]) | ((tk[None, :] == tk[:, None]) & (col < row)))
    rank_t = (tl.sum((before_tt & in_col).to(tl.int64), axis=1)
              + tl.sum(((ek[None, :] > tk[:, None]) & in_col).to(tl.int64), axis=1))
    before_ee = ((ek[None, :] > ek[:, None]) | ((ek[None, :] == ek[:, None]) & (col < row)))
    rank_e = (tl.sum(((tk[None, :] >= ek[:, None]) & in_col).to(tl.int64), axis=1)
              + tl.sum((before_ee & in_col).to(tl.int64), axis=1))
    keep_t = (g_real | (idx == 0)) & (rank_t < n)
    keep_e = new & (rank_e < n)
    # parents in rank space: a trie candidate's parent is a trie node; an EAGLE node's is the
    # trie node its parent duplicates (or the root), else its parent's EAGLE candidate
    gpar_of = col == g_par_c[:, None]
    parent_t = tl.sum(tl.where(gpar_of, rank_t[None, :], 0), axis=1)
    par_dup = tl.max(tl.where(par_of, dup[None, :].to(tl.int32), 0), axis=1) > 0
    par_mapped = tl.maximum(tl.sum(tl.where(par_of, mapped[None, :], 0), axis=1), 0)
    via_trie = par_dup | (e_par_c == 0)
    parent_e = tl.where(
        via_trie,
        tl.sum(tl.where(col == par_mapped[:, None], rank_t[None, :], 0), axis=1),
        tl.sum(tl.where(par_of, rank_e[None, :], 0), axis=1))
    # the scatter into rank order, as a masked sum per output column r
    at_t = keep_t[None, :] & (rank_t[None, :] == row)  # [r, j]
    at_e = keep_e[None, :] & (rank_e[None, :] == row)  # [r, i]
    filled = (tl.max(at_t.to(tl.int32), axis=1) + tl.max(at_e.to(tl.int32), axis=1)) > 0
    tok = (tl.sum(tl.where(at_t, g_tok[None, :], 0), axis=1)
           + tl.sum(tl.where(at_e, e_tok[None, :], 0), axis=1))
    par = (tl.sum(tl.where(at_t, parent_t[None, :], 0), axis=1)
           + tl.sum(tl.where(at_e, parent_e[None, :], 0), axis=1))
    tok = tl.where(filled, tok, -1)
    par = tl.where(idx == 0, -1, tl.where(filled, par, 0))
    tl.store(OutTok + base + idx, tok, mask=inb)
    tl.store(OutPar + base + idx, par, mask=inb)


def union_trees_kernel(
    ngram_tokens: torch.Tensor, ngram_parents: torch.Tensor, ngram_scores: torch.Tensor,
    eagle_tokens: torch.Tensor, eagle_parents: torch.Tensor, eagle_depth: torch.Tensor,
    eagle_scores: torch.Tensor, *, max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~structspec.speculative.tree_union.union_trees` in one launch (same arguments,
    same results; no host sync, capturable).

    Args:
        ngram_tokens, ngram_parents: ``[B, N]`` int64 trie; ``ngram_scores`` ``[B, N]``
            float32 (any strides).
        eagle_tokens, eagle_parents, eagle_depth: ``[B, N]`` int64 EAGLE tree;
            ``eagle_scores`` ``[B, N]`` float32.
        max_depth: the deepest EAGLE node, >= 0.

    Returns:
        ``(tokens [B, N], parents [B, N])`` int64.

    Raises:
        ValueError: ``N`` above :data:`MAX_NODES`.
    """
    bsz, n = ngram_tokens.shape
    n_pad, num_warps = tree_row_tiles(n, MAX_NODES)
    device = ngram_tokens.device
    ins = [t.contiguous() for t in (ngram_tokens, ngram_parents, ngram_scores, eagle_tokens,
                                     eagle_parents, eagle_depth, eagle_scores)]
    tokens = torch.empty((bsz, n), dtype=torch.int64, device=device)
    parents = torch.empty((bsz, n), dtype=torch.int64, device=device)
    if bsz:
        _union_kernel[(bsz,)](*ins, tokens, parents, n, N_PAD=n_pad, MAX_DEPTH=max_depth,
                              num_warps=num_warps)
    return tokens, parents
