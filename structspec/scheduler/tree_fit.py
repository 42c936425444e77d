"""Lay a step's drafted trees into the batch's verify tree at the planned size.

The drafter proposes ``[S, N_max]`` trees for the ``S`` requests the
:class:`~structspec.scheduler.tree_sizing.AdaptiveTreeSizer` drafts; the verify takes a
``[B, N]`` tree for the whole batch, ``N <= N_max`` the plan's size. A drafted row keeps its
first ``N`` nodes: every drafter lays parents before children (n-gram: the trie in merge order,
best continuation first; draft model / EAGLE: the selected candidates in expansion order), so
a prefix of the nodes is a tree. A request that is not drafted gets the root alone, padded
with -1 nodes (which no target token matches), exactly the rows a failed drafter gets
(:func:`~structspec.scheduler.draft_guard.root_only_padded`).

Host values that a device tree needs (the root tokens and padding of a mixed batch, the row
index of the drafted rows, a whole host tree for a device drafter's step) go to the device
through :mod:`structspec.staging`'s pinned ring: one ``non_blocking`` copy each, queued on the
stream that reads it, no host sync (docs/architecture.md, invariant 6).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.staging import Staging, stack_to_device, to_device

#: the :class:`VerifyTree` fields of one dtype (int64 ``[B, N]``), staged with one copy
_INT_FIELDS = ("draft_tokens", "parents", "depth", "next_token", "next_sibling")


def real_nodes(tree: VerifyTree) -> list[int]:
    """Per row, the index after its last real node of a host tree (node 0 counts): the
    columns a verify needs. Host tensors only (reading a device tree would sync). In numpy:
    a few calls whatever the batch (torch's small CPU ops cost ~0.1 ms more at batch 64).

    Raises:
        ValueError: a tree on a device other than the CPU.
    """
    if tree.device.type != "cpu":
        raise ValueError("real_nodes reads host trees only")
    tokens = tree.draft_tokens.numpy()
    n = tokens.shape[1]
    real = tokens >= 0
    real[:, 0] = True
    # the last real column + 1 (padding can only trail: drafters pad at the end)
    return np.where(real, np.arange(1, n + 1), 0).max(axis=1, initial=0).tolist()


def tree_to_device(tree: VerifyTree, device: torch.device,
                   staging: Staging | None) -> VerifyTree:
    """A host tree on ``device``: the five int64 ``[B, N]`` fields in one staged copy, the bool
    ancestor mask in another (``non_blocking`` from the pinned ring, no host sync); without
    ``staging`` (CPU runs) plain copies. A tree already on ``device`` is returned as is.

    Args:
        tree: a :class:`VerifyTree` (host, or already on ``device``).
        device: the model device.
        staging: the runner's :class:`~structspec.staging.Staging`, or None on CPU.
    """
    if tree.device == device:
        return tree
    if staging is None or tree.device.type != "cpu":
        return tree.to(device)
    ints = stack_to_device([getattr(tree, f) for f in _INT_FIELDS], device, staging)
    fields = dict(zip(_INT_FIELDS, ints, strict=True))
    return VerifyTree(**fields, ancestor_mask=to_device(tree.ancestor_mask, device, staging))


def fit_trees(last_tokens: Sequence[int], drafted: Sequence[int], tree: VerifyTree | None,
              num_nodes: int, staging: Staging | None = None) -> VerifyTree:
    """The batch's ``[B, num_nodes]`` verify tree.

    Args:
        last_tokens: ``B`` host ints, each request's last committed token (node 0).
        drafted: ascending batch indices of the requests ``tree`` holds, in its row order
            (checked: :func:`check_drafted`).
        tree: ``[len(drafted), N_max]`` drafted trees (host or device), ``N_max >=
            num_nodes``; None when nothing was drafted.
        num_nodes: ``N`` (>= 1).
        staging: the runner's pinned staging (CUDA), through which a device tree's host
            values (root tokens, padding, drafted-row index) travel; None on CPU.

    Returns:
        A :class:`VerifyTree` on ``tree``'s device (the host when None): drafted rows keep
        their first ``num_nodes`` nodes, the others are root-only padded. When every row was
        drafted the tree is only cut (no host-to-device copy); otherwise a device tree gets
        its host values with one staged ``non_blocking`` copy (no host sync).

    Raises:
        ValueError: ``drafted`` is not ascending batch indices (a negative, repeated,
            out-of-order or out-of-range index: :func:`check_drafted`), ``tree``'s rows do
            not match ``drafted``, or it is narrower than ``num_nodes``.
    """
    bsz = len(last_tokens)
    if tree is None or not drafted:
        return _root_only(last_tokens, num_nodes)
    check_drafted(drafted, bsz)
    if tree.batch_size != len(drafted) or tree.num_nodes < num_nodes:
        raise ValueError(f"drafted trees {tree.batch_size}x{tree.num_nodes} do not fit "
                         f"{len(drafted)} drafted rows of {num_nodes} nodes")
    tokens = tree.draft_tokens[:, :num_nodes]
    parents = tree.parents[:, :num_nodes]
    if len(drafted) == bsz:
        if tree.device.type == "cpu":
            # sliced, not laid out again (~60 us less host per step at batch 8-64 on a 2-core
            # VM: benchmarks/host_tree_fit.py); a device tree's layout is one Triton launch
            return tree.prefix(num_nodes)
        if num_nodes == tree.num_nodes:
            return tree
        return VerifyTree.from_parents(tokens.contiguous(), parents.contiguous())
    if tree.device.type == "cpu" and staging is None:
        # a host tree (n-gram, or any drafter on a CPU run): its rows copied in, not laid out
        return _scatter_host_rows(last_tokens, drafted, tree, num_nodes)
    device = tree.device
    # the root-only rows and the drafted-row index, one host buffer: one staged copy
    host = torch.full((bsz * num_nodes + len(drafted),), -1, dtype=torch.int64)
    host[: bsz * num_nodes].view(bsz, num_nodes)[:, 0] = torch.tensor(list(last_tokens),
                                                                      dtype=torch.int64)
    host[bsz * num_nodes :] = torch.tensor(list(drafted), dtype=torch.int64)
    staged = to_device(host, device, staging)  # on the CPU: ``host`` itself
    full_tokens = staged[: bsz * num_nodes].view(bsz, num_nodes)
    idx = staged[bsz * num_nodes :]
    full_parents = torch.zeros((bsz, num_nodes), dtype=torch.int64, device=device)
    full_tokens[idx] = tokens
    full_parents[idx] = parents
    return VerifyTree.from_parents(full_tokens, full_parents)


def check_drafted(drafted: Sequence[int], bsz: int) -> None:
    """Refuse ``drafted`` unless it is strictly ascending batch indices in ``[0, bsz)``.

    A negative index wrote a row counted from the end, a repeated one a row twice, an
    out-of-order one paired trees with the wrong requests (a wrong verify, no error); one
    past the batch failed inside numpy or torch indexing, naming no argument. One chained
    comparison per index in plain Python (about 1.5 us at batch 64, every step); the
    wording is worked out only on failure.

    Raises:
        ValueError: naming ``drafted``, the first bad index and its value.
    """
    prev = -1
    for i in drafted:
        if not prev < i < bsz:
            _refuse_drafted(drafted, bsz)
        prev = i


def _refuse_drafted(drafted: Sequence[int], bsz: int) -> None:
    """Raise the :class:`ValueError` for the first bad index of ``drafted``
    (:func:`check_drafted`)."""
    prev = None
    for k, i in enumerate(drafted):
        if not 0 <= i < bsz:
            raise ValueError(f"drafted[{k}]={i!r} is not a batch index: the batch has {bsz} "
                             f"rows (drafted must be ascending indices in [0, {bsz}))")
        if prev is not None and i == prev:
            raise ValueError(f"drafted[{k}]={i!r} repeats drafted[{k - 1}] (drafted must be "
                             "ascending batch indices, each once)")
        if prev is not None and i < prev:
            raise ValueError(f"drafted[{k}]={i!r} is below drafted[{k - 1}]={prev!r} "
                             "(drafted must be ascending batch indices)")
        prev = i
    # not reached for numbers (check_drafted found a bad index); kept for odd values
    raise ValueError(f"drafted={list(drafted)!r} is not ascending batch indices in "
                     f"[0, {bsz})")


@functools.lru_cache(maxsize=64)
def _root_only_row(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The layout of one root-only row of ``num_nodes`` nodes (root token 0, the rest -1
    padding), the same for every such row, so laid out once per width: ``[5, N]`` int64 (the
    :data:`_INT_FIELDS` rows) and ``[N, N]`` bool ancestors. Read-only."""
    tokens = torch.full((1, num_nodes), -1, dtype=torch.int64)
    tokens[0, 0] = 0
    row = VerifyTree.from_parents(tokens, torch.zeros_like(tokens))
    ints = np.stack([getattr(row, f)[0].numpy() for f in _INT_FIELDS])
    ints.flags.writeable = False
    anc = row.ancestor_mask[0].numpy().copy()
    anc.flags.writeable = False
    return ints, anc


def _root_only_arrays(last_tokens: Sequence[int], num_nodes: int,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``[5, B, N]`` int64 fields and ``[B, N, N]`` bool ancestors of ``B`` root-only rows:
    the cached row layout repeated (:func:`_root_only_row`), the root tokens written in."""
    row_ints, row_anc = _root_only_row(num_nodes)
    bsz = len(last_tokens)
    ints = np.empty((len(_INT_FIELDS), bsz, num_nodes), dtype=np.int64)
    ints[:] = row_ints[:, None, :]
    ints[0, :, 0] = last_tokens
    anc = np.empty((bsz, num_nodes, num_nodes), dtype=bool)
    anc[:] = row_anc
    return ints, anc


def _tree_of_arrays(ints: np.ndarray, anc: np.ndarray) -> VerifyTree:
    """A host :class:`VerifyTree` over ``[5, B, N]`` int64 fields (each ``[B, N]`` slice
    contiguous) and ``[B, N, N]`` bool ancestors, without copies."""
    fields = {f: torch.from_numpy(ints[k]) for k, f in enumerate(_INT_FIELDS)}
    return VerifyTree(**fields, ancestor_mask=torch.from_numpy(anc))


def _root_only(last_tokens: Sequence[int], num_nodes: int) -> VerifyTree:
    """Root plus ``num_nodes - 1`` padding nodes per row (host)."""
    if num_nodes == 1:
        return VerifyTree.root_only(torch.tensor(list(last_tokens), dtype=torch.int64))
    return _tree_of_arrays(*_root_only_arrays(list(last_tokens), num_nodes))


def _scatter_host_rows(last_tokens: Sequence[int], drafted: Sequence[int], tree: VerifyTree,
                       num_nodes: int) -> VerifyTree:
    """A host batch whose ``drafted`` rows are ``tree``'s first ``num_nodes`` nodes and whose
    other rows are root-only. A row's layout depends on that row alone, so the drafted rows'
    layouts are sliced as :meth:`VerifyTree.prefix` slices them (links past the cut become
    -1) straight into repeated root-only rows, in numpy, rather than the batch laid out
    again (``benchmarks/host_tree_fit.py``, the ``mixed`` rows)."""
    n = num_nodes
    ints, anc = _root_only_arrays(list(last_tokens), n)
    idx = np.asarray(drafted, dtype=np.int64)
    for k, f in enumerate(_INT_FIELDS):
        field = getattr(tree, f).numpy()[:, :n]
        if f in ("next_token", "next_sibling"):
            field = np.where(field >= n, -1, field)
        ints[k, idx] = field
    anc[idx] = tree.ancestor_mask.numpy()[:, :n, :n]
    return _tree_of_arrays(ints, anc)
