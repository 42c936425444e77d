"""Tree verification: which draft path the target accepts, and the bonus token.

Both greedy and sampled verification use *sample-and-match*: every tree row gets one target
token ``y_i`` (argmax of the masked logits at temperature 0, else a draw from the masked,
filtered target distribution), and a child is accepted iff its draft token equals ``y`` of its
parent. With drafts treated as deterministic proposals (one-hot draft distributions) this is
exactly the multi-draft speculative sampling of SpecInfer (Miao et al., 2024, "SpecInfer",
Alg. 2 with one-hot q): accepting child c with probability p(c) and otherwise renormalising the
residual p - q is the same as drawing y ~ p once and matching it against the children. The
output distribution therefore equals the target's, and at temperature 0 the output equals plain
greedy decoding token for token. Every row is masked with its own path's grammar state, so a
draft the grammar forbids never equals ``y`` and is never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from structspec.draft_tree.layout import VerifyTree


@dataclass
class VerifyResult:
    """Outcome of verifying a batch of trees (tensors on the verify device).

    Attributes:
        accept_tokens: ``[B, N]`` int64; the first ``accept_len[b]`` entries are the committed
            run (accepted drafts, then the bonus token); the rest are -1.
        accept_len: ``[B]`` int64, committed tokens including the bonus (>= 1; the
            scheduler's selection sets 0 for a request whose logits were not finite).
        accept_nodes: ``[B, N]`` int64 node index at each depth of the accepted path (entry 0
            is node 0), -1 beyond ``accept_len``.
    """

    accept_tokens: torch.Tensor
    accept_len: torch.Tensor
    accept_nodes: torch.Tensor


def verify_tree(
    tree: VerifyTree, target_tokens: torch.Tensor, max_accept_drafts: torch.Tensor | None = None
) -> VerifyResult:
    """Find the longest draft path the target agrees with. No host syncs.

    Args:
        tree: the verify tree, ``N`` nodes per request.
        target_tokens: ``[B, N]`` int64 target token of every node row (argmax or sample).
        max_accept_drafts: optional ``[B]`` int64 cap on accepted drafts per request (0 keeps
            only the bonus); used when a grammar tree walk was cut short.

    Returns:
        :class:`VerifyResult`. Ties between equally deep accepted nodes (duplicate sibling
        tokens) go to the lowest node index.
    """
    return verify_paths(tree.draft_tokens, tree.parents, tree.depth, tree.ancestor_mask,
                        target_tokens, max_accept_drafts)


def verify_paths(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    ancestor_mask: torch.Tensor,
    target_tokens: torch.Tensor,
    max_accept_drafts: torch.Tensor | None = None,
) -> VerifyResult:
    """:func:`verify_tree` on the tree's fields (what a CUDA graph records on static buffers).

    Args:
        draft_tokens, parents, depth: ``[B, N]`` int64 (see :class:`VerifyTree`).
        ancestor_mask: ``[B, N, N]`` bool.
        target_tokens, max_accept_drafts: as in :func:`verify_tree`.

    Every op has a static shape and none reads a value on the host, so the function can be
    captured in a CUDA graph.
    """
    bsz, n = draft_tokens.shape
    device = draft_tokens.device
    if n == 1:  # plain decode: the run is the bonus token alone
        zeros = torch.zeros((bsz, 1), dtype=torch.int64, device=device)
        return VerifyResult(accept_tokens=target_tokens.view(bsz, 1).clone(),
                            accept_len=torch.ones(bsz, dtype=torch.int64, device=device),
                            accept_nodes=zeros)
    rows = torch.arange(bsz, device=device)
    parent = parents.clamp(min=0)
    parent_target = torch.gather(target_tokens, 1, parent)
    ok = draft_tokens == parent_target
    ok[:, 0] = True
    # A path is accepted when every node on it (its ancestors-or-self) matches its parent's
    # target: one [B, N, N] reduction over the ancestor mask, where a walk down the columns
    # (path_ok[i] &= path_ok[parent[i]]) was ~3 ops per node (21 launches in a post graph at
    # N = 8, ~150 us of CPU time per eager step at batch 1)
    path_ok = ~(ancestor_mask & ~ok.unsqueeze(1)).any(dim=2)
    if max_accept_drafts is not None:
        path_ok &= depth <= max_accept_drafts.view(-1, 1)
    score = torch.where(path_ok, depth * n + (n - 1 - torch.arange(n, device=device)), -1)
    last = score.argmax(dim=1)
    accept_len = depth[rows, last] + 1
    on_path = ancestor_mask[rows, last]  # [B, N], ancestors-or-self of `last`
    idx = torch.arange(n, device=device).expand(bsz, n)
    # Parents precede children, so sorting path node indices orders them by depth.
    accept_nodes = torch.where(on_path, idx, torch.full_like(idx, n)).sort(dim=1).values
    valid = idx < accept_len.view(-1, 1)
    accept_nodes = torch.where(valid, accept_nodes, torch.full_like(accept_nodes, -1))
    accept_tokens = torch.gather(target_tokens, 1, accept_nodes.clamp(min=0))
    accept_tokens = torch.where(valid, accept_tokens, torch.full_like(accept_tokens, -1))
    return VerifyResult(accept_tokens=accept_tokens, accept_len=accept_len, accept_nodes=accept_nodes)
