"""Lay a step's drafted trees into the batch's verify tree at the planned size.

The drafter proposes ``[S, N_max]`` trees for the ``S`` requests the
:class:`~structspec.scheduler.tree_sizing.AdaptiveTreeSizer` drafts; the verify takes a
``[B, N]`` tree for the whole batch, ``N <= N_max`` the plan's size. A drafted row keeps its
first ``N`` nodes: every drafter lays parents before children (n-gram: the trie in merge order,
best continuation first; draft model / EAGLE: the selected candidates in expansion order), so
a prefix of the nodes is a tree. A request that is not drafted gets the root alone, padded
with -1 nodes (which no target token matches), exactly the rows a failed drafter gets
(:func:`~structspec.scheduler.draft_guard.root_only_padded`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structspec.draft_tree.layout import VerifyTree


def real_nodes(tree: VerifyTree) -> list[int]:
    """Per row, the index after its last real node of a host tree (node 0 counts): the
    columns a verify needs. Host tensors only (reading a device tree would sync).

    Raises:
        ValueError: a tree on a device other than the CPU.
    """
    if tree.device.type != "cpu":
        raise ValueError("real_nodes reads host trees only")
    tokens = tree.draft_tokens
    n = tokens.shape[1]
    real = tokens >= 0
    real[:, 0] = True
    # the last real column + 1 (padding can only trail: drafters pad at the end)
    last = torch.where(real, torch.arange(1, n + 1).expand_as(tokens), 0).amax(dim=1)
    return last.tolist()


def fit_trees(last_tokens: Sequence[int], drafted: Sequence[int], tree: VerifyTree | None,
              num_nodes: int) -> VerifyTree:
    """The batch's ``[B, num_nodes]`` verify tree.

    Args:
        last_tokens: ``B`` host ints, each request's last committed token (node 0).
        drafted: ascending batch indices of the requests ``tree`` holds, in its row order.
        tree: ``[len(drafted), N_max]`` drafted trees (host or device), ``N_max >=
            num_nodes``; None when nothing was drafted.
        num_nodes: ``N`` (>= 1).

    Returns:
        A :class:`VerifyTree` on ``tree``'s device (the host when None): drafted rows keep
        their first ``num_nodes`` nodes, the others are root-only padded. When every row was
        drafted the tree is only cut (no host-to-device copy).

    Raises:
        ValueError: ``tree``'s rows do not match ``drafted``, or it is narrower than
            ``num_nodes``.
    """
    bsz = len(last_tokens)
    if tree is None or not drafted:
        return _root_only(torch.tensor(list(last_tokens), dtype=torch.int64), num_nodes)
    if tree.batch_size != len(drafted) or tree.num_nodes < num_nodes:
        raise ValueError(f"drafted trees {tree.batch_size}x{tree.num_nodes} do not fit "
                         f"{len(drafted)} drafted rows of {num_nodes} nodes")
    tokens = tree.draft_tokens[:, :num_nodes]
    parents = tree.parents[:, :num_nodes]
    if len(drafted) == bsz:
        if num_nodes == tree.num_nodes:
            return tree
        return VerifyTree.from_parents(tokens.contiguous(), parents.contiguous())
    device = tree.device
    full_tokens = torch.full((bsz, num_nodes), -1, dtype=torch.int64)
    full_tokens[:, 0] = torch.tensor(list(last_tokens), dtype=torch.int64)
    full_tokens = full_tokens.to(device)
    full_parents = torch.zeros((bsz, num_nodes), dtype=torch.int64, device=device)
    idx = torch.tensor(list(drafted), dtype=torch.int64).to(device)
    full_tokens[idx] = tokens
    full_parents[idx] = parents
    return VerifyTree.from_parents(full_tokens, full_parents)


def _root_only(last_tokens: torch.Tensor, num_nodes: int) -> VerifyTree:
    """Root plus ``num_nodes - 1`` padding nodes per row (host)."""
    if num_nodes == 1:
        return VerifyTree.root_only(last_tokens)
    tokens = torch.full((last_tokens.shape[0], num_nodes), -1, dtype=torch.int64)
    tokens[:, 0] = last_tokens
    return VerifyTree.from_parents(tokens, torch.zeros_like(tokens))
