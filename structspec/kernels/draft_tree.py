"""Draft-tree bookkeeping in a few Triton launches: EAGLE-2 expansion and verify-tree layout.

At the batch sizes of a propose, the EAGLE-2 expansion's torch ops (top-k per frontier node,
cumulative scores, the frontier's ranking and gathers, the final node selection) and the
verify-tree layout of a device tree (ancestor mask, depth, first-child / next-sibling links:
one ``[B, N, N]`` pass per node) are ~150 kernels of a few microseconds each, about half of a
propose CUDA graph (``benchmarks/propose_launches.py``). Each kernel here runs one program per
request and replaces one of those groups:

* :func:`expand_frontier` - one expansion step: the top-``k`` children of each of ``P``
  frontier nodes, their cumulative scores written as candidates, the ``k`` best of the
  ``P * k`` as the next frontier, and the next step's scratch-column mask.
* :func:`select_nodes` - the ``N - 1`` best candidates laid out as tree nodes 1..N-1.
* :func:`tree_layout` - :meth:`~structspec.draft_tree.layout.VerifyTree.from_parents`.

Results are equal, element for element, to the torch reference ops
(:func:`structspec.speculative.expansion.expand_tree`,
:meth:`~structspec.draft_tree.layout.VerifyTree.from_parents`): only comparisons, one float32
addition per candidate (as in the reference) and copies. Ties rank in index order, as there;
a NaN log-probability ranks first among a node's children (``torch.max``'s order) and a NaN
score as ``-inf`` in the rankings (:func:`~structspec.speculative.expansion.rank_order`), so a
broken draft head yields in-range (if useless) drafts, never an out-of-range id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structspec.kernels import next_pow2, tree_row_tiles

MAX_TOPK = 4
"""Largest ``topk`` the expansion kernel unrolls (``topk**2`` rounds per step)."""

MAX_VOCAB_BLOCK = 65536
"""Largest draft vocabulary (rounded up to a power of two) held in one program's registers."""

MAX_CANDIDATES = 256
"""Largest candidate count :func:`select_nodes` ranks pairwise (``[C, C]`` tiles)."""

MAX_NODES = 128
"""Largest tree :func:`tree_layout` lays out (``[N, N]`` tiles; ``config.MAX_DRAFT_TOKENS``)."""


@triton.jit
def _expand_kernel(
    LogP, stride_lb, stride_lp, vocab,
    FrontScores, FrontCand, VocabMap,
    CandScores, CandTokens, CandParents, stride_cb, cand_offset,
    NextScores, NextTokens, NextParent, NextCand,
    AncIn, AncOut, scratch, own_col,
    P: tl.constexpr, K: tl.constexpr, PK_PAD: tl.constexpr, K_PAD: tl.constexpr,
    S_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_FRONT: tl.constexpr, HAS_MAP: tl.constexpr, HAS_ANC_IN: tl.constexpr,
    HAS_ANC_OUT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    in_vocab = cols < vocab
    slots = tl.arange(0, PK_PAD)  # candidate slot j * K + c: child c of frontier node j
    cand_v = tl.full([PK_PAD], float("-inf"), tl.float32)
    cand_i = tl.zeros([PK_PAD], tl.int64)
    cand_p = tl.full([PK_PAD], -1, tl.int64)
    for j in tl.static_range(P):
        x = tl.load(LogP + b * stride_lb + j * stride_lp + cols, mask=in_vocab,
                    other=float("-inf")).to(tl.float32)
        if HAS_FRONT:
            base = tl.load(FrontScores + b * P + j)
            parent_cand = tl.load(FrontCand + b * P + j)
        for c in tl.static_range(K):
            # the largest remaining entry, the first of equal ones (expansion.top_k's order:
            # torch.max's, where NaN ranks above every number)
            is_nan = x != x
            nan_i = tl.min(tl.where(is_nan, cols, BLOCK_V), axis=0)
            m = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
            i = tl.min(tl.where(x == m, cols, BLOCK_V), axis=0)
            has_nan = nan_i < BLOCK_V
            i = tl.minimum(tl.where(has_nan, nan_i, i), vocab - 1)  # always a real column
            m = tl.where(has_nan, float("nan"), m)
            x = tl.where(cols == i, float("-inf"), x)
            here = slots == j * K + c
            if HAS_FRONT:
                cand_v = tl.where(here, base + m, cand_v)  # the reference's one float32 add
                cand_p = tl.where(here, parent_cand, cand_p)
            else:
                cand_v = tl.where(here, m, cand_v)
            cand_i = tl.where(here, i.to(tl.int64), cand_i)
    real = slots < P * K
    if HAS_MAP:
        cand_t = tl.load(VocabMap + cand_i, mask=real, other=-1)
    else:
        cand_t = cand_i
    out = CandScores + b * stride_cb + cand_offset + slots
    tl.store(out, cand_v, mask=real)
    tl.store(CandTokens + b * stride_cb + cand_offset + slots, cand_t, mask=real)
    tl.store(CandParents + b * stride_cb + cand_offset + slots, cand_p, mask=real)

    # The next frontier: the K best slots by (score descending, slot ascending); NaN ranks
    # as -inf (the reference's nan_to_num before its stable sort).
    key = tl.where(real & (cand_v == cand_v), cand_v, float("-inf"))
    if not HAS_FRONT:  # the root's children are the frontier in their top-k order, unranked
        key = tl.where(real, 0.0, float("-inf"))
    taken = slots < 0
    front = tl.arange(0, K_PAD)
    nxt_v = tl.zeros([K_PAD], tl.float32)
    nxt_t = tl.zeros([K_PAD], tl.int64)
    nxt_s = tl.zeros([K_PAD], tl.int64)
    for c in tl.static_range(K):
        live = real & ~taken
        m = tl.max(tl.where(live, key, float("-inf")), axis=0)
        s = tl.min(tl.where(live & (key == m), slots, PK_PAD), axis=0)
        pick = slots == s
        taken = taken | pick
        here = front == c
        # the picked slot's score plus zeros: exact, NaN and -inf kept (tl.max drops NaN)
        nxt_v = tl.where(here, tl.sum(tl.where(pick, cand_v, 0.0), axis=0), nxt_v)
        nxt_t = tl.where(here, tl.sum(tl.where(pick, cand_t, 0), axis=0), nxt_t)
        nxt_s = tl.where(here, s.to(tl.int64), nxt_s)
    ok = front < K
    tl.store(NextScores + b * K + front, nxt_v, mask=ok)
    tl.store(NextTokens + b * K + front, nxt_t, mask=ok)
    tl.store(NextParent + b * K + front, nxt_s // K, mask=ok)
    tl.store(NextCand + b * K + front, cand_offset + nxt_s, mask=ok)
    if HAS_ANC_OUT:
        # next frontier node c sees its parent's scratch columns and its own (own_col + c)
        cols_s = tl.arange(0, S_PAD)
        grid_ok = ok[:, None] & (cols_s[None, :] < scratch)
        anc = (cols_s[None, :] == own_col + front[:, None]).to(tl.uint8)
        if HAS_ANC_IN:
            parent_rows = (nxt_s // K)[:, None]
            inherited = tl.load(AncIn + b * P * scratch + parent_rows * scratch + cols_s[None, :],
                                mask=grid_ok, other=0)
            anc = anc | inherited
        tl.store(AncOut + b * K * scratch + front[:, None] * scratch + cols_s[None, :], anc,
                 mask=grid_ok)


def expand_frontier(
    logp: torch.Tensor,
    front_scores: torch.Tensor | None,
    front_cand: torch.Tensor | None,
    vocab_map: torch.Tensor | None,
    cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cand_offset: int,
    k: int,
    anc_in: torch.Tensor | None = None,
    anc_out: torch.Tensor | None = None,
    own_col: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EAGLE-2 expansion step in one launch (no host sync; capturable).

    Each of the ``P`` frontier nodes of a request proposes its ``k`` likeliest children; child
    ``c`` of node ``j`` becomes candidate ``cand_offset + j * k + c`` with score
    ``front_scores[j] + logp[j, child]`` and parent candidate ``front_cand[j]``; the ``k``
    best of the ``P * k`` (score descending, candidate ascending) form the next frontier.

    Args:
        logp: ``[B, P, V']`` (or ``[B, V']``: ``P = 1``, the root) float log-probabilities over
            the draft vocabulary, unit stride on ``V'``; CUDA (or CPU under the interpreter).
        front_scores: ``[B, P]`` float32 cumulative scores of the frontier nodes, or None for
            the root (its children's scores are their log-probabilities).
        front_cand: ``[B, P]`` int64 candidate index of each frontier node, or None for the
            root (parent candidate -1).
        vocab_map: ``[V']`` int64 target id of each draft id, or None (identity).
        cand: ``(scores [B, C] float32, tokens [B, C] int64, parents [B, C] int64)``, written
            at columns ``cand_offset .. cand_offset + P * k - 1`` (same strides).
        cand_offset: the first candidate index of this step.
        k: children per node and frontier width, ``1 <= k <= min(MAX_TOPK, V')``.
        anc_in: ``[B, P, S]`` uint8 (a bool tensor's bytes) scratch columns each frontier node
            sees, or None (none: the root).
        anc_out: ``[B, k, S]`` uint8 written for the next frontier: its parent's row plus its
            own column ``own_col + c``; None when no step follows.
        own_col: the next frontier's first scratch column.

    Returns:
        ``(scores [B, k] float32, tokens [B, k] int64 target ids, parent [B, k] int64 index of
        each node's parent in this frontier, cand [B, k] int64 candidate indices)``.

    Raises:
        ValueError: ``k`` out of range, or a vocabulary above :data:`MAX_VOCAB_BLOCK`.
    """
    if logp.dim() == 2:
        logp = logp.unsqueeze(1)
    bsz, p, vocab = logp.shape
    if not 1 <= k <= min(MAX_TOPK, vocab):
        raise ValueError(f"k={k}: expected 1..{min(MAX_TOPK, vocab)}")
    block_v = next_pow2(vocab)
    if block_v > MAX_VOCAB_BLOCK:
        raise ValueError(f"draft vocabulary {vocab} above {MAX_VOCAB_BLOCK}")
    if logp.stride(-1) != 1:
        logp = logp.contiguous()
    device = logp.device
    scores, tokens, parents = cand
    out = (torch.empty((bsz, k), dtype=torch.float32, device=device),
           torch.empty((bsz, k), dtype=torch.int64, device=device),
           torch.empty((bsz, k), dtype=torch.int64, device=device),
           torch.empty((bsz, k), dtype=torch.int64, device=device))
    scratch = anc_out.shape[2] if anc_out is not None else 0
    dummy = out[1]
    if bsz:
        _expand_kernel[(bsz,)](
            logp, logp.stride(0), logp.stride(1), vocab,
            front_scores if front_scores is not None else out[0],
            front_cand if front_cand is not None else dummy,
            vocab_map if vocab_map is not None else dummy,
            scores, tokens, parents, scores.stride(0), cand_offset,
            *out,
            anc_in if anc_in is not None else dummy,
            anc_out if anc_out is not None else dummy, scratch, own_col,
            P=p, K=k, PK_PAD=next_pow2(p * k), K_PAD=next_pow2(k),
            S_PAD=next_pow2(max(scratch, 1)), BLOCK_V=block_v,
            HAS_FRONT=front_scores is not None, HAS_MAP=vocab_map is not None,
            HAS_ANC_IN=anc_in is not None, HAS_ANC_OUT=anc_out is not None,
            num_warps=max(4, min(16, block_v // 2048)),
        )
    return out


@triton.jit
def _select_kernel(
    CandScores, CandTokens, CandParents, stride_cb, num_cand,
    OutTokens, OutParents, OutScores, num_nodes,
    C_PAD: tl.constexpr, N_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ci = tl.arange(0, C_PAD)
    ok = ci < num_cand
    s = tl.load(CandScores + b * stride_cb + ci, mask=ok, other=float("-inf"))
    tok = tl.load(CandTokens + b * stride_cb + ci, mask=ok, other=-1)
    par = tl.load(CandParents + b * stride_cb + ci, mask=ok, other=-1)
    key = tl.where(ok & (s == s), s, float("-inf"))  # NaN ranks as -inf (rank_order)
    row = ci[:, None]
    col = ci[None, :]
    # rank of candidate `row`: the candidates ordered before it (score desc, index asc)
    before = ((key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (col < row)))
    rank = tl.sum((before & ok[None, :]).to(tl.int32), axis=1)
    sel = ok & (rank < num_nodes - 1)
    # node of a selected candidate: 1 + the selected candidates before it (ancestry order);
    # a parent's node the same way (-1 = the root, node 0)
    node = 1 + tl.sum((sel[None, :] & (col < row)).to(tl.int32), axis=1)
    par_node = 1 + tl.sum((sel[None, :] & (col < tl.maximum(par, 0)[:, None])).to(tl.int32),
                          axis=1)
    par_node = tl.where(par < 0, 0, par_node).to(tl.int64)
    ni = tl.arange(0, N_PAD)
    match = sel[None, :] & (node[None, :] == ni[:, None])  # [N, C]: node n holds candidate c
    filled = tl.max(match.to(tl.int32), axis=1) > 0
    out_tok = tl.where(filled, tl.sum(tl.where(match, tok[None, :], 0), axis=1), -1)
    out_par = tl.sum(tl.where(match, par_node[None, :], 0), axis=1)
    out_par = tl.where(ni == 0, -1, out_par)
    # one match per filled node: its score plus zeros, exactly (NaN and -inf kept)
    out_s = tl.where(filled, tl.sum(tl.where(match, s[None, :], 0.0), axis=1), float("-inf"))
    out_s = tl.where(ni == 0, 0.0, out_s)
    n_ok = ni < num_nodes
    tl.store(OutTokens + b * num_nodes + ni, out_tok, mask=n_ok)
    tl.store(OutParents + b * num_nodes + ni, out_par, mask=n_ok)
    tl.store(OutScores + b * num_nodes + ni, out_s, mask=n_ok)


def select_nodes(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~structspec.speculative.expansion.select_top_nodes` in one launch.

    Args:
        scores: ``[B, C]`` float32 candidate scores, ``C <= MAX_CANDIDATES``.
        tokens: ``[B, C]`` int64, same strides as ``scores``.
        parents: ``[B, C]`` int64 parent candidate (-1 = the root), same strides.
        num_nodes: ``N`` (node 0 included), ``1 <= N <= MAX_NODES``.

    Returns:
        ``(tokens [B, N] int64, parents [B, N] int64, scores [B, N] float32)``: node 0 has
        token -1, parent -1 and score 0; padding nodes token -1, parent 0, score ``-inf``.

    Raises:
        ValueError: ``C`` or ``N`` out of range.
    """
    bsz, c = scores.shape
    if not 1 <= c <= MAX_CANDIDATES or not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"{c} candidates / {num_nodes} nodes: expected 1..{MAX_CANDIDATES} "
                         f"/ 1..{MAX_NODES}")
    device = scores.device
    out_tokens = torch.empty((bsz, num_nodes), dtype=torch.int64, device=device)
    out_parents = torch.empty((bsz, num_nodes), dtype=torch.int64, device=device)
    out_scores = torch.empty((bsz, num_nodes), dtype=torch.float32, device=device)
    if bsz:
        c_pad = next_pow2(c)
        _select_kernel[(bsz,)](
            scores, tokens, parents, scores.stride(0), c,
            out_tokens, out_parents, out_scores, num_nodes,
            C_PAD=c_pad, N_PAD=next_pow2(num_nodes), num_warps=4 if c_pad <= 64 else 8,
        )
    return out_tokens, out_parents, out_scores


@triton.jit
def _layout_kernel(
    Tokens, Parents, OutParents, Depth, NextToken, NextSibling, Anc, n,
    N_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    base = b * n
    idx = tl.arange(0, N_PAD)
    inb = idx < n
    tok = tl.load(Tokens + base + idx, mask=inb, other=-1)
    raw = tl.load(Parents + base + idx, mask=inb, other=0)
    valid = (tok >= 0) | (idx == 0)
    par = tl.where(idx == 0, -1, tl.where(valid, raw, 0))  # padding nodes hang off node 0
    row = idx[:, None]
    col = idx[None, :]
    # Ancestors: walk every node up its parent links at once (at most n - 1 hops); a link
    # below 0 counts as the root, as the reference's clamp does.
    anc = (row == col).to(tl.int32)  # int32, not int1, as the loop-carried tile
    cur = tl.where(inb & (idx > 0), tl.minimum(tl.maximum(par, 0), n - 1), -1)
    for _ in range(1, n):
        anc = anc | (col == cur[:, None]).to(tl.int32)
        up = cur > 0
        up_raw = tl.load(Parents + base + cur, mask=up, other=0)
        up_tok = tl.load(Tokens + base + cur, mask=up, other=-1)
        up_par = tl.where(up_tok >= 0, tl.minimum(tl.maximum(up_raw, 0), n - 1), 0)
        cur = tl.where(up, up_par, -1)
    depth = tl.sum(tl.where(inb[None, :], anc, 0).to(tl.int64), axis=1) - 1
    real = valid & (idx > 0) & inb
    # first child of p: the smallest real c with parent p; next sibling of i: the smallest
    # real j > i with i's parent (i real)
    child = (par[None, :] == row) & real[None, :]
    first = tl.min(tl.where(child, col, N_PAD), axis=1)
    later = (par[None, :] == par[:, None]) & (col > row) & real[None, :] & real[:, None]
    sibling = tl.min(tl.where(later, col, N_PAD), axis=1)
    tl.store(OutParents + base + idx, par, mask=inb)
    tl.store(Depth + base + idx, depth, mask=inb)
    tl.store(NextToken + base + idx, tl.where(first < n, first, -1).to(tl.int64), mask=inb)
    tl.store(NextSibling + base + idx, tl.where(sibling < n, sibling, -1).to(tl.int64),
             mask=inb)
    tl.store(Anc + b * n * n + row * n + col, anc.to(tl.uint8), mask=inb[:, None] & inb[None, :])


def tree_layout(
    draft_tokens: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`~structspec.draft_tree.layout.VerifyTree.from_parents`'s derived fields in one
    launch (no host sync; capturable).

    Args:
        draft_tokens: ``[B, N]`` int64, -1 = padding node; ``N <= MAX_NODES``; contiguous.
        parents: ``[B, N]`` int64 (``parents[b, i] < i`` for real nodes), contiguous.

    Returns:
        ``(parents, depth, next_token, next_sibling [B, N] int64, ancestor_mask [B, N, N]
        bool)`` as ``VerifyTree`` defines them.

    Raises:
        ValueError: ``N`` above :data:`MAX_NODES`.
    """
    bsz, n = draft_tokens.shape
    n_pad, num_warps = tree_row_tiles(n, MAX_NODES)
    device = draft_tokens.device
    draft_tokens = draft_tokens.contiguous()
    parents = parents.contiguous()
    outs = [torch.empty((bsz, n), dtype=torch.int64, device=device) for _ in range(4)]
    anc = torch.empty((bsz, n, n), dtype=torch.bool, device=device)
    if bsz:
        _layout_kernel[(bsz,)](draft_tokens, parents, *outs, anc.view(torch.uint8), n,
                               N_PAD=n_pad, num_warps=num_warps)
    return outs[0], outs[1], outs[2], outs[3], anc
