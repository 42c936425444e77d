"""EAGLE-2 dynamic draft-tree expansion: the maths, independent of any draft network.

Tree expansion follows EAGLE-2 (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees", arXiv:2406.16858) in the form sglang implements it (written from
that public description):

* step 0: the ``topk`` most likely children of the root (node 0, the last committed token),
  scored by their log-probability;
* steps ``1 .. depth-1``: ONE batched draft forward over every request's ``topk`` frontier
  nodes (tree attention: each frontier node sees the committed prefix, its ancestors and
  itself); each frontier node proposes its ``topk`` children, scored by the cumulative
  log-probability of their path; the ``topk`` best of those ``topk * topk`` form the next
  frontier;
* finally the ``N - 1`` candidates with the highest cumulative score over all steps become
  nodes 1..N-1, ordered by candidate index (parents before children).

Cumulative scores are sums of log-probabilities (the log of EAGLE-2's product of
probabilities). Ranking is by ``(score descending, candidate index ascending)``; since a child's
score never exceeds its parent's (a log-probability is ``<= 0`` and float rounding of
``x + l`` with ``l <= 0`` never exceeds ``x``) and a parent's candidate index is smaller than
its children's, every selected node's parent ranks strictly earlier, so the selected set is
ancestor-closed and ties are deterministic.

The draft forwards themselves are a callback (:data:`StepFn`); the drafters that run them
(draft model, EAGLE) share :class:`~structspec.speculative.tree_drafter.TreeDrafter`, and their
forward batches come from :mod:`structspec.speculative.draft_batches`. Everything here is
device ops only (no host syncs), so it can be recorded in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: ``step_fn(step, tokens, parent, scratch_mask) -> logp``: run the draft over the frontier of
#: ``step`` (1-based): ``tokens [B, k]`` int64 (target vocabulary), ``parent [B, k]`` int64
#: index of each node's parent in the previous frontier (step 1: zeros, the root),
#: ``scratch_mask [B, k, S]`` bool scratch columns each node may see; returns ``[B, k, V']``
#: float32 log-probabilities of the nodes' children (draft vocabulary).
StepFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExpandedTree:
    """Result of :func:`expand_tree`, on the device of the inputs.

    Attributes:
        tokens: ``[B, N]`` int64; column 0 is -1 here (the caller puts the root token there);
            -1 for padding nodes.
        parents: ``[B, N]`` int64 parent node index (-1 for node 0, 0 for padding nodes).
        scores: ``[B, N]`` float32 cumulative log-probability of each node (0 for node 0,
            ``-inf`` for padding).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor


#: ``k`` up to which :func:`top_k` takes maxima one at a time instead of ``torch.topk``
SMALL_TOP_K = 4


def top_k(x: torch.Tensor, k: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of ``x`` along ``dim``, largest first; equal values in index
    order (deterministic, unlike ``torch.topk``'s unspecified order of ties).

    Why: at the small batches of a propose, ``torch.topk`` over a draft vocabulary runs
    CUDA's single-block radix select, ~42-48 us per call on the H200 (4 calls per EAGLE
    propose at N=8 / depth 4 / top-k 2: ~0.19 ms of a ~1.5 ms propose graph, 2026-12-03
    trace); ``k`` max-reductions with the taken entries set to ``-inf`` in between are a few
    us each. Above :data:`SMALL_TOP_K`, ``torch.topk``.

    Args:
        x: float tensor (e.g. ``[B, V']`` or ``[B, k, V']`` log-probabilities); not modified.
        k: ``1 <= k <= x.shape[dim]``.
        dim: the dimension to reduce.

    Returns:
        ``(values, indices)``, ``x``'s shape with ``dim`` of size ``k``; indices int64. NaN
        ranks above every number (as in ``torch.max``). A row with fewer than ``k`` entries
        above ``-inf`` repeats the first ``-inf`` index (log-probabilities of a softmax over
        finite logits have none).
    """
    if k > SMALL_TOP_K:
        top = torch.topk(x, k, dim=dim)
        return top.values, top.indices
    values, indices = [], []
    for j in range(k):
        v, i = x.max(dim=dim, keepdim=True)  # the first maximal index on ties
        values.append(v)
        indices.append(i)
        if j + 1 < k:
            x = x.scatter(dim, i, float("-inf"))  # out of place: the caller's x is kept
    if k == 1:
        return values[0], indices[0]
    return torch.cat(values, dim), torch.cat(indices, dim)


def rank_order(scores: torch.Tensor) -> torch.Tensor:
    """Candidate indices sorted by ``(score descending, index ascending)``.

    Args:
        scores: ``[B, C]`` float.

    Returns:
        ``[B, C]`` int64. A NaN score ranks as ``-inf`` (in index order among them).
    """
    # (infinities kept: nan_to_num's default would turn -inf into -FLT_MAX, above NaN)
    clean = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=float("inf"),
                             neginf=float("-inf"))
    # A stable ascending sort of the negated scores keeps equal scores in index order.
    return torch.sort(-clean, dim=1, stable=True).indices


def select_top_nodes(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> ExpandedTree:
    """Pick the ``num_nodes - 1`` best candidates and lay them out as tree nodes 1..N-1.

    Args:
        scores: ``[B, C]`` float32 cumulative log-probabilities of all candidates.
        tokens: ``[B, C]`` int64 candidate tokens.
        parents: ``[B, C]`` int64 candidate index of each candidate's parent (-1 = the root);
            ``parents[b, c] < c`` and ``scores[b, c] <= scores[b, parents[b, c]]``.
        num_nodes: ``N`` (node 0 included).

    Returns:
        :class:`ExpandedTree` with ``N`` columns; when ``C < N - 1`` the tail is padding.
    """
    bsz, c = scores.shape
    device = scores.device
    m = min(num_nodes - 1, c)
    sel = rank_order(scores)[:, :m].sort(dim=1).values  # [B, m], ancestry order
    sel_tokens = torch.gather(tokens, 1, sel)
    sel_scores = torch.gather(scores.float(), 1, sel)
    par_cand = torch.gather(parents, 1, sel)
    # A selected parent's node index is its rank among the selected candidates, plus 1.
    par_node = torch.searchsorted(sel.contiguous(), par_cand.clamp(min=0).contiguous()) + 1
    par_node = torch.where(par_cand < 0, torch.zeros_like(par_node), par_node)
    out_tokens = torch.full((bsz, num_nodes), -1, dtype=torch.int64, device=device)
    out_parents = torch.zeros((bsz, num_nodes), dtype=torch.int64, device=device)
    out_scores = torch.full((bsz, num_nodes), float("-inf"), dtype=torch.float32, device=device)
    out_tokens[:, 1 : m + 1] = sel_tokens
    out_parents[:, 1 : m + 1] = par_node
    out_scores[:, 1 : m + 1] = sel_scores
    out_parents[:, 0] = -1
    out_scores[:, 0] = 0.0
    return ExpandedTree(tokens=out_tokens, parents=out_parents, scores=out_scores)


def expand_tree(
    root_logp: torch.Tensor,
    step_fn: StepFn,
    *,
    topk: int,
    depth: int,
    num_nodes: int,
    vocab_map: torch.Tensor | None = None,
) -> ExpandedTree:
    """EAGLE-2 dynamic tree expansion (see the module docstring). No host syncs.

    Where the index kernels run (CUDA, or the CPU under Triton's interpreter; see
    :func:`~structspec.kernels.index_kernels_usable`) and the shapes fit them, each step's
    bookkeeping is one launch of :mod:`structspec.kernels.draft_tree`, with the same result.

    Args:
        root_logp: ``[B, V']`` float32 log-probabilities of the root's children (draft vocab).
        step_fn: runs one batched draft forward over a frontier (:data:`StepFn`).
        topk: children kept per expanded node and frontier width (``>= 1``).
        depth: expansion depth (``>= 1``): drafts reach depth ``depth``; ``depth - 1`` calls
            of ``step_fn``.
        num_nodes: ``N``, tree size including node 0.
        vocab_map: optional ``[V']`` int64 target token id of each draft-vocabulary id
            (EAGLE-3's reduced vocabulary); None = identity.

    Returns:
        :class:`ExpandedTree` ``[B, N]``.
    """
    bsz = root_logp.shape[0]
    device = root_logp.device
    k = min(topk, root_logp.shape[1])
    scratch = (depth - 1) * k
    if _tree_kernels_apply(root_logp, k, depth, num_nodes):
        return _expand_tree_kernels(root_logp, step_fn, k=k, depth=depth, num_nodes=num_nodes,
                                    vocab_map=vocab_map)

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids if vocab_map is None else vocab_map[ids]

    top_values, top_indices = top_k(root_logp.float(), k, dim=1)
    scores = [top_values]  # per step: [B, k] then [B, k*k]
    tokens = [to_target(top_indices)]
    parents = [torch.full((bsz, k), -1, dtype=torch.int64, device=device)]
    front_scores = top_values  # [B, k]
    front_tokens = tokens[0]  # [B, k]
    front_cand = torch.arange(k, device=device).expand(bsz, k)  # candidate index of each node
    front_parent = torch.zeros((bsz, k), dtype=torch.int64, device=device)
    # Frontier node j of step s writes scratch column (s-1)*k + j: its own column is row
    # (s-1)*k + j of the identity (built once: a graph replays every step's ops)
    own_cols = torch.eye(scratch, dtype=torch.bool, device=device)
    front_anc = torch.zeros((bsz, k, scratch), dtype=torch.bool, device=device)
    offset = k
    for step in range(1, depth):
        front_anc = front_anc | own_cols[(step - 1) * k : step * k].unsqueeze(0)
        logp = step_fn(step, front_tokens, front_parent, front_anc)  # [B, k, V']
        child_values, child_indices = top_k(logp.float(), k, dim=2)
        cum = front_scores.unsqueeze(2) + child_values  # [B, k, k]
        flat_scores = cum.reshape(bsz, k * k)
        flat_tokens = to_target(child_indices).reshape(bsz, k * k)
        flat_parents = front_cand.unsqueeze(2).expand(bsz, k, k).reshape(bsz, k * k)
        scores.append(flat_scores)
        tokens.append(flat_tokens)
        parents.append(flat_parents)
        keep = rank_order(flat_scores)[:, :k]  # [B, k] local indices of the new frontier
        front_scores = torch.gather(flat_scores, 1, keep)
        front_tokens = torch.gather(flat_tokens, 1, keep)
        front_parent = torch.div(keep, k, rounding_mode="floor")
        front_cand = offset + keep
        front_anc = torch.gather(front_anc, 1, front_parent.unsqueeze(2).expand(bsz, k, scratch))
        offset += k * k
    return select_top_nodes(
        torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), num_nodes
    )


def _tree_kernels_apply(root_logp: torch.Tensor, k: int, depth: int, num_nodes: int) -> bool:
    """Whether :func:`expand_tree` runs on the Triton kernels of
    :mod:`structspec.kernels.draft_tree` (:func:`~structspec.kernels.index_kernels_usable`,
    and shapes within the kernels' limits)."""
    from structspec.kernels import index_kernels_usable

    if not index_kernels_usable(root_logp):
        return False
    from structspec.kernels import draft_tree

    candidates = k + (depth - 1) * k * k
    return (k <= draft_tree.MAX_TOPK and root_logp.shape[1] <= draft_tree.MAX_VOCAB_BLOCK
            and candidates <= draft_tree.MAX_CANDIDATES and num_nodes <= draft_tree.MAX_NODES)


def _expand_tree_kernels(
    root_logp: torch.Tensor, step_fn: StepFn, *, k: int, depth: int, num_nodes: int,
    vocab_map: torch.Tensor | None,
) -> ExpandedTree:
    """:func:`expand_tree` with each step's bookkeeping in one Triton launch (the root's
    top-k, every frontier's top-k / ranking / scratch mask, the final selection): equal
    results, ~``15 * depth`` fewer kernels for a propose graph to replay (see
    :mod:`structspec.kernels.draft_tree`)."""
    from structspec.kernels.draft_tree import expand_frontier, select_nodes

    bsz = root_logp.shape[0]
    device = root_logp.device
    scratch = (depth - 1) * k
    num_cand = k + (depth - 1) * k * k
    cand = (torch.empty((bsz, num_cand), dtype=torch.float32, device=device),
            torch.empty((bsz, num_cand), dtype=torch.int64, device=device),
            torch.empty((bsz, num_cand), dtype=torch.int64, device=device))

    def scratch_mask() -> torch.Tensor | None:
        if not scratch:
            return None
        return torch.empty((bsz, k, scratch), dtype=torch.bool, device=device)

    front_anc = scratch_mask()
    front_scores, front_tokens, front_parent, front_cand = expand_frontier(
        root_logp, None, None, vocab_map, cand, 0, k,
        anc_out=None if front_anc is None else front_anc.view(torch.uint8), own_col=0)
    offset = k
    for step in range(1, depth):
        assert front_anc is not None
        logp = step_fn(step, front_tokens, front_parent, front_anc)  # [B, k, V']
        next_anc = scratch_mask() if step + 1 < depth else None
        front_scores, front_tokens, front_parent, front_cand = expand_frontier(
            logp, front_scores, front_cand, vocab_map, cand, offset, k,
            anc_in=front_anc.view(torch.uint8),
            anc_out=None if next_anc is None else next_anc.view(torch.uint8),
            own_col=step * k)
        front_anc = next_anc
        offset += k * k
    tokens, parents, scores = select_nodes(*cand, num_nodes)
    return ExpandedTree(tokens=tokens, parents=parents, scores=scores)
