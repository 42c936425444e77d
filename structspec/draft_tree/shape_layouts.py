"""Host tree layouts looked up by tree shape: the n-gram drafter's trees repeat a few shapes.

Every n-gram propose lays out a batch of host trees (``VerifyTree.from_parents``: ancestor
mask, depth, first child, next sibling). Those fields depend only on the tree's shape, its
parent links and how many nodes are real, never on its tokens, and the n-gram drafter's
shapes repeat: a chain whenever the best continuation fills the tree (most JSON steps), and a
few tries otherwise (at most ``(N-1)!`` parent lists with parents before children). So
:class:`ShapeLayouts` lays out each shape once, keeps the per-shape rows in ``[S, ...]``
tables, and assembles a batch with one gather per field instead of per-column passes over
the batch (``benchmarks/ngram_draft.py`` reports the propose time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree

#: Shapes kept before the tables are cleared and refilled (bounds memory for large trees:
#: 4,096 shapes of 64 nodes hold 16 MiB of ancestor masks; 8-node trees have at most 5,040).
DEFAULT_MAX_SHAPES = 4096


class ShapeLayouts:
    """Lays out host trees of ``num_nodes`` nodes from per-shape tables.

    A tree is ``(tokens, parents)``: Python lists of the same length ``1 <= L <= num_nodes``,
    node 0 first (its parent -1), ``0 <= parents[i] < i`` for ``i >= 1``, real tokens
    ``>= 0`` (each checked: a tree that breaks them raises ``ValueError``). The layout equals
    :func:`pack_trees` of the batch (the trees padded with -1 tokens and laid out by
    ``VerifyTree.from_parents``) field by field (tested).

    Not thread-safe: one instance per drafter, used from the scheduler thread.

    Args:
        num_nodes: ``N``, the padded tree width (>= 1).
        max_shapes: distinct shapes kept; when a new one would exceed it, the tables are
            cleared (the next calls lay their shapes out again).

    Raises:
        ValueError: ``num_nodes`` or ``max_shapes`` below 1.
    """

    def __init__(self, num_nodes: int, max_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes}: must be >= 1")
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes}: must be >= 1")
        self.num_nodes = num_nodes
        self.max_shapes = max_shapes
        self._generation = -1  # counts the tables' clears (the first fill included)
        self._clear()

    def _clear(self) -> None:
        n = self.num_nodes
        self._index: dict[tuple[int, ...], int] = {}
        # [S, N] int64 parents / depth / next_token / next_sibling, [S, N, N] bool ancestors;
        # capacity doubles as shapes arrive, rows [0, len(_index)) are filled
        self._fields = np.empty((0, 4, n), dtype=np.int64)
        self._ancestors = np.empty((0, n, n), dtype=bool)
        self._generation += 1

    def __len__(self) -> int:
        """Shapes held now."""
        return len(self._index)

    def _add(self, key: tuple[int, ...]) -> int:
        """Lay out one new shape (its parents ``key``) and return its table row.

        Raises:
            ValueError: ``key`` is not a parent list (:func:`_check_parents`).
        """
        n = self.num_nodes
        _check_parents(key, n)
        if len(self._index) >= self.max_shapes:
            self._clear()
        row = len(self._index)
        if row == len(self._fields):
            grow = max(8, 2 * row)
            self._fields = np.concatenate(
                [self._fields, np.empty((grow - row, 4, n), dtype=np.int64)])
            self._ancestors = np.concatenate(
                [self._ancestors, np.empty((grow - row, n, n), dtype=bool)])
        real = len(key)
        tokens = torch.tensor([[0] * real + [-1] * (n - real)], dtype=torch.int64)
        parents = torch.tensor([[*key, *([0] * (n - real))]], dtype=torch.int64)
        tree = VerifyTree.from_parents(tokens, parents)
        self._fields[row] = torch.stack(
            [tree.parents[0], tree.depth[0], tree.next_token[0], tree.next_sibling[0]]).numpy()
        self._ancestors[row] = tree.ancestor_mask[0].numpy()
        self._index[key] = row
        return row

    def layout(self, trees: Sequence[tuple[list[int], list[int]]]) -> VerifyTree:
        """The host :class:`VerifyTree` of ``B`` trees, padded to ``num_nodes``.

        Args:
            trees: ``B >= 0`` pairs ``(tokens, parents)`` as described on the class.

        Returns:
            A :class:`VerifyTree` of ``[B, N]`` int64 CPU tensors (``ancestor_mask``
            ``[B, N, N]`` bool), every tensor a fresh array the caller may modify.

        Raises:
            ValueError: a tree that does not fit (see :meth:`_add`), or whose token and parent
                lists differ in length.
        """
        n = self.num_nodes
        if not trees:  # an empty batch: [0, N] tensors
            return pack_trees(trees, n)
        rows = []
        tok_rows = []
        num_padding = 0
        index = self._index
        generation = self._generation
        for toks, pars in trees:
            if len(toks) != len(pars):
                raise ValueError(f"a tree of {len(toks)} tokens and {len(pars)} parents: "
                                 "expected one parent per token")
            key = tuple(pars)
            row = index.get(key)
            if row is None:
                row = self._add(key)
                if self._generation != generation:
                    # the tables were cleared for this shape: earlier rows of this batch are
                    # gone, and the batch may hold more shapes than fit, so lay it out whole
                    if rows:
                        return pack_trees(trees, n)
                    index, generation = self._index, self._generation
            rows.append(row)
            pad = n - len(toks)
            num_padding += pad
            tok_rows.append(toks + [-1] * pad if pad else toks)
        idx = np.array(rows, dtype=np.int64)
        fields = self._fields[idx].transpose(1, 0, 2).copy()  # [4, B, N], each [B, N] contiguous
        tokens = np.array(tok_rows, dtype=np.int64).reshape(len(rows), n)
        _check_tokens(tokens, num_padding)
        return VerifyTree(
            draft_tokens=torch.from_numpy(tokens),
            parents=torch.from_numpy(fields[0]),
            depth=torch.from_numpy(fields[1]),
            next_token=torch.from_numpy(fields[2]),
            next_sibling=torch.from_numpy(fields[3]),
            ancestor_mask=torch.from_numpy(self._ancestors[idx]),
        )


def _check_parents(parents: Sequence[int], num_nodes: int) -> None:
    """Raise ``ValueError`` unless ``parents`` lays out a tree of ``1..num_nodes`` nodes:
    node 0's parent -1, every other node's an earlier node."""
    if not 1 <= len(parents) <= num_nodes or parents[0] != -1 or any(
            not 0 <= p < i for i, p in enumerate(parents[1:], start=1)):
        raise ValueError(f"parents {list(parents)}: expected node 0's parent -1 and every "
                         f"other parent an earlier node, at most {num_nodes} nodes")


def _check_tokens(tokens: np.ndarray, num_padding: int) -> None:
    """Raise ``ValueError`` when a real node's token is negative: ``tokens`` ``[B, N]`` holds
    ``num_padding`` padding -1s, so any other negative entry is a real node's (which
    ``VerifyTree.from_parents`` would take for padding: the table's layout would differ)."""
    if np.count_nonzero(tokens < 0) != num_padding:
        raise ValueError("a real node's token is negative (-1 marks padding): real tokens "
                         "are token ids >= 0")


def pack_trees(trees: Sequence[tuple[list[int], list[int]]], num_nodes: int) -> VerifyTree:
    """Pad ``(tokens, parents)`` lists to ``num_nodes`` (token -1, parent 0) and lay the batch
    out with ``VerifyTree.from_parents`` (``[B, num_nodes]`` int64 host tensors), each tree
    checked as :meth:`ShapeLayouts.layout` checks it: the layout without the per-shape
    tables (an empty batch, tables cleared mid-batch, the n-gram drafter's single-request
    path).

    Raises:
        ValueError: as :meth:`ShapeLayouts.layout`.
    """
    tokens, parents, num_padding = [], [], 0
    for toks, pars in trees:
        if len(toks) != len(pars):
            raise ValueError(f"a tree of {len(toks)} tokens and {len(pars)} parents: "
                             "expected one parent per token")
        _check_parents(pars, num_nodes)
        pad = num_nodes - len(toks)
        num_padding += pad
        tokens.append([*toks, *([-1] * pad)])
        parents.append([*pars, *([0] * pad)])
    shape = (len(trees), num_nodes)
    tokens_np = np.array(tokens, dtype=np.int64).reshape(shape)
    _check_tokens(tokens_np, num_padding)
    return VerifyTree.from_parents(torch.from_numpy(tokens_np),
                                   torch.tensor(parents, dtype=torch.int64).reshape(shape))
