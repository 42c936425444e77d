"""The verify tree: one layout for every drafter (none, ngram, draft_model, eagle).

Per request the tree has exactly ``N`` nodes (``N = SpecConfig.tree_size``). Node 0 is the last
committed token (the previous step's bonus, whose KV this verify forward writes); nodes
1..N-1 are drafts in an order where every parent precedes its children. A drafter that proposes
fewer than N-1 drafts pads with *padding nodes*: token -1, parent 0, linked into no child or
sibling chain, so they can never be accepted and the grammar never visits them.

Layout after sglang's EAGLE verify inputs (``retrieve_next_token`` / ``retrieve_next_sibling``,
first-child / next-sibling links with -1 = none); written from the description, not the code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

#: Host trees of batches up to this size are laid out in plain Python
#: (:meth:`VerifyTree._from_parents_lists`: cost ~ ``B * N``), larger ones in numpy (~ ``N``
#: numpy passes); the crossover measured on a 2-core EPYC VM lies at batch 8-16 for N = 8 and
#: 16 (benchmarks/README.md, "Host work of a small-batch speculative step").
HOST_LIST_LAYOUT_MAX_BATCH = 8
#: bit ``j`` of an ancestor bitset is node ``j``
_BIT_INDEX = np.arange(64, dtype=np.uint64)


@dataclass
class VerifyTree:
    """A batch of draft trees. All tensors on the same device (host for ngram/none).

    Attributes:
        draft_tokens: ``[B, N]`` int64 token per node; -1 marks a padding node.
        parents: ``[B, N]`` int64 parent node index; -1 for node 0; 0 for padding nodes.
        depth: ``[B, N]`` int64 depth of each node (node 0: 0; padding nodes: 1).
        next_token: ``[B, N]`` int64 first child of each node, -1 if none (``retrieve_next_token``).
        next_sibling: ``[B, N]`` int64 next sibling, -1 if none (``retrieve_next_sibling``).
        ancestor_mask: ``[B, N, N]`` bool, ``[b, i, j]`` True if node j is node i or one of
            its ancestors (the tree part of the verify attention mask).
        host_links: ``[4, B', N]`` int64 on the same device, ``B' >= B``, whose rows
            ``[:, :B]`` hold ``next_token``, ``next_sibling``, ``draft_tokens`` and
            ``parents`` in that order: what the grammar mask build reads on the host, ready
            to go there as one contiguous copy (a propose graph's static output,
            :mod:`~structspec.speculative.draft_graph`). None for every other tree: a tree
            built or changed from another leaves it None, and the fields are then staged one
            by one.
    """

    draft_tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    ancestor_mask: torch.Tensor
    host_links: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return int(self.draft_tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.draft_tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.draft_tokens.device

    @property
    def positions_offset(self) -> torch.Tensor:
        """``[B, N]`` int64: node position relative to the request's committed length."""
        return self.depth

    @classmethod
    def from_parents(cls, draft_tokens: torch.Tensor, parents: torch.Tensor) -> VerifyTree:
        """Build all derived fields from tokens and parent links (any device, no host sync).

        Args:
            draft_tokens: ``[B, N]`` int64, column 0 = last committed token, -1 = padding.
            parents: ``[B, N]`` int64, ``parents[:, 0]`` ignored (root), ``parents[b, i] < i``
                for real nodes; padding nodes are re-parented to 0.

        Raises:
            ValueError: when shapes differ.
        """
        if draft_tokens.shape != parents.shape or draft_tokens.dim() != 2:
            raise ValueError(
                f"draft_tokens {tuple(draft_tokens.shape)} and parents "
                f"{tuple(parents.shape)} must both be [B, N]"
            )
        if draft_tokens.device.type == "cpu":
            return cls._from_parents_host(draft_tokens, parents)
        if _layout_kernel_applies(draft_tokens):
            from structspec.kernels.draft_tree import tree_layout

            par, depth, next_token, next_sibling, anc = tree_layout(draft_tokens, parents)
            return cls(draft_tokens=draft_tokens, parents=par, depth=depth,
                       next_token=next_token, next_sibling=next_sibling, ancestor_mask=anc)
        return cls._from_parents_torch(draft_tokens, parents)

    @classmethod
    def _from_parents_torch(cls, draft_tokens: torch.Tensor, parents: torch.Tensor) -> VerifyTree:
        """:meth:`from_parents` in torch ops (device trees: no host sync, any device)."""
        bsz, n = draft_tokens.shape
        device = draft_tokens.device
        valid = draft_tokens >= 0
        valid[:, 0] = True
        parents = torch.where(valid, parents, torch.zeros_like(parents))
        parents = parents.clone()
        parents[:, 0] = -1
        eye = torch.eye(n, dtype=torch.bool, device=device).expand(bsz, n, n)
        anc = eye.clone()
        # Parents precede children, so one pass in node order sees every parent's row complete.
        for i in range(1, n):
            par = parents[:, i].clamp(min=0)
            anc[:, i] |= anc[torch.arange(bsz, device=device), par]
        depth = anc.sum(-1) - 1
        idx = torch.arange(n, device=device)
        big = torch.full((bsz, n, n), n, dtype=torch.int64, device=device)
        real = valid.clone()
        real[:, 0] = False  # the root is nobody's child
        # child_of[b, p, c] = c is a real child of p
        child_of = (parents.unsqueeze(1) == idx.view(1, n, 1)) & real.unsqueeze(1)
        first_child = torch.where(child_of, idx.view(1, 1, n).expand(bsz, n, n), big).min(-1).values
        next_token = torch.where(first_child < n, first_child, torch.full_like(first_child, -1))
        # later_sibling[b, i, j] = j > i, same parent, both real
        same_parent = parents.unsqueeze(2) == parents.unsqueeze(1)
        later = idx.view(1, 1, n) > idx.view(1, n, 1)
        later_sibling = same_parent & later & real.unsqueeze(1) & real.unsqueeze(2)
        nxt = torch.where(later_sibling, idx.view(1, 1, n).expand(bsz, n, n), big).min(-1).values
        next_sibling = torch.where(nxt < n, nxt, torch.full_like(nxt, -1))
        return cls(
            draft_tokens=draft_tokens,
            parents=parents,
            depth=depth,
            next_token=next_token,
            next_sibling=next_sibling,
            ancestor_mask=anc,
        )

    @classmethod
    def _from_parents_host(cls, draft_tokens: torch.Tensor, parents: torch.Tensor) -> VerifyTree:
        """:meth:`from_parents` for host tensors (the n-gram drafter builds its trees on the
        host every step, where torch's small CPU ops cost ~ms at batch 32): small batches in
        plain Python (:meth:`_from_parents_lists`), larger ones in numpy, one pass per tree
        column (:meth:`_from_parents_numpy`). Both give the torch path's layout."""
        bsz, n = draft_tokens.shape
        if bsz <= HOST_LIST_LAYOUT_MAX_BATCH and n <= 64:
            return cls._from_parents_lists(draft_tokens, parents)
        return cls._from_parents_numpy(draft_tokens, parents)

    @classmethod
    def _from_parents_lists(cls, draft_tokens: torch.Tensor,
                            parents: torch.Tensor) -> VerifyTree:
        """:meth:`_from_parents_numpy`'s passes over Python lists, each node's ancestors as
        the bits of one int (``N <= 64``), converted to tensors once. The numpy passes cost
        ~5 numpy calls per tree column whatever the batch (~140 us for one 8-node tree on
        a 2-core EPYC VM, most of an n-gram propose at batch 1); these cost a few Python
        operations per node. ``parents`` keeps its dtype, as in the other paths.

        Raises:
            ValueError: ``N > 64`` (the bitsets are uint64; :meth:`_from_parents_host` sends
                such trees to the numpy passes).
        """
        bsz, n = draft_tokens.shape
        if n > 64:
            raise ValueError(f"{n} nodes: the list layout holds at most 64 (uint64 bitsets)")
        par_rows: list[list[int]] = []
        anc_rows: list[list[int]] = []
        depth_rows: list[list[int]] = []
        next_rows: list[list[int]] = []
        sib_rows: list[list[int]] = []
        for toks, pars in zip(draft_tokens.tolist(), parents.tolist(), strict=True):
            valid = [True] + [t >= 0 for t in toks[1:]]
            par = [-1] + [p if v else 0 for p, v in zip(pars[1:], valid[1:], strict=True)]
            anc = [1 << j for j in range(n)]
            for i in range(1, n):  # parents precede children: each parent's bits are final
                anc[i] |= anc[max(par[i], 0)]
            # a real node under a negative parent files under a virtual column n (as numpy)
            first = [-1] * (n + 1)
            sib = [-1] * n
            for c in range(n - 1, 0, -1):
                if valid[c]:
                    p = par[c] if par[c] >= 0 else n
                    sib[c] = first[p]
                    first[p] = c
            par_rows.append(par)
            anc_rows.append(anc)
            depth_rows.append([a.bit_count() - 1 for a in anc])
            next_rows.append(first[:n])
            sib_rows.append(sib)
        # one conversion for the four int64 fields ([4, B, N]: each [B, N] slice contiguous)
        fields = torch.from_numpy(np.array([par_rows, depth_rows, next_rows, sib_rows],
                                           dtype=np.int64).reshape(4, bsz, n))
        bits = np.array(anc_rows, dtype=np.uint64).reshape(bsz, n, 1)
        anc_mask = (bits >> _BIT_INDEX[:n]) & np.uint64(1)
        return cls(draft_tokens=draft_tokens, parents=fields[0].to(parents.dtype), depth=fields[1],
                   next_token=fields[2], next_sibling=fields[3],
                   ancestor_mask=torch.from_numpy(anc_mask.astype(bool)))

    @classmethod
    def _from_parents_numpy(cls, draft_tokens: torch.Tensor,
                            parents: torch.Tensor) -> VerifyTree:
        """:meth:`from_parents` for host tensors in numpy: one pass per tree column instead
        of ``[B, N, N]`` torch reductions."""
        toks = draft_tokens.numpy()
        bsz, n = toks.shape
        valid = toks >= 0
        valid[:, 0] = True
        par = np.where(valid, parents.numpy(), 0)
        par[:, 0] = -1
        rows = np.arange(bsz)
        anc = np.broadcast_to(np.eye(n, dtype=bool), (bsz, n, n)).copy()
        # A real node whose parent is negative (no drafter makes one) hangs under no node, as
        # in the torch path: its ancestors are its own (row 0's: clamped like torch), and the
        # walk below files it under a virtual column n (numpy's -1 would wrap to node n-1).
        for i in range(1, n):  # parents precede children: each parent's row is complete
            anc[:, i] |= anc[rows, np.maximum(par[:, i], 0)]
        depth = anc.sum(-1) - 1
        next_token = np.full((bsz, n + 1), -1, dtype=np.int64)
        next_sibling = np.full((bsz, n), -1, dtype=np.int64)
        # Walk children from the last node back: a node's next sibling is the child of the
        # same parent seen just before it, and a parent's first child is the last one seen.
        for c in range(n - 1, 0, -1):
            real = rows[valid[:, c]]
            p = par[real, c]
            p = np.where(p < 0, n, p)
            next_sibling[real, c] = next_token[real, p]
            next_token[real, p] = c
        next_token = np.ascontiguousarray(next_token[:, :n])
        return cls(
            draft_tokens=draft_tokens,
            parents=torch.from_numpy(par),
            depth=torch.from_numpy(depth.astype(np.int64)),
            next_token=torch.from_numpy(next_token),
            next_sibling=torch.from_numpy(next_sibling),
            ancestor_mask=torch.from_numpy(anc),
        )

    @classmethod
    def root_only(cls, last_tokens: torch.Tensor) -> VerifyTree:
        """The degenerate tree of plain decoding: node 0 only. ``last_tokens``: ``[B]`` int64."""
        tokens = last_tokens.view(-1, 1).to(torch.int64)
        minus_one = torch.full_like(tokens, -1)
        return cls(draft_tokens=tokens, parents=minus_one, depth=torch.zeros_like(tokens),
                   next_token=minus_one, next_sibling=minus_one,
                   ancestor_mask=torch.ones(tokens.shape[0], 1, 1, dtype=torch.bool,
                                            device=tokens.device))

    def prefix(self, num_nodes: int) -> VerifyTree:
        """Each row's first ``num_nodes`` nodes as a tree, sliced from this layout instead of
        laid out again (the adaptive sizer cuts every drafted host tree to its plan's size).

        Parents precede children, so a prefix of the nodes is a tree whose parents, depths
        and ancestor mask are this tree's. A first-child or next-sibling link past the cut
        becomes -1: a node's first child is its lowest-numbered child and its next sibling
        the next-numbered one, so when that one is cut so are all the later ones. Equal, field
        by field, to :meth:`from_parents` of the first ``num_nodes`` columns
        (``tests/draft_tree/test_layout.py``). Contiguous tensors on this tree's device, which
        share this tree's memory where the cut is contiguous already (a batch of one;
        ``num_nodes`` equal to :attr:`num_nodes`: this tree itself).

        Args:
            num_nodes: nodes kept per row, ``1 <= num_nodes <= self.num_nodes``.

        Raises:
            ValueError: ``num_nodes`` out of that range.
        """
        n = num_nodes
        if not 1 <= n <= self.num_nodes:
            raise ValueError(f"num_nodes={n}: a prefix of a {self.num_nodes}-node tree has "
                             f"1..{self.num_nodes} nodes")
        if n == self.num_nodes:
            return self

        def cut_link(link: torch.Tensor) -> torch.Tensor:
            link = link[:, :n]
            return torch.where(link >= n, torch.full_like(link, -1), link)

        return VerifyTree(draft_tokens=self.draft_tokens[:, :n].contiguous(),
                          parents=self.parents[:, :n].contiguous(),
                          depth=self.depth[:, :n].contiguous(),
                          next_token=cut_link(self.next_token),
                          next_sibling=cut_link(self.next_sibling),
                          ancestor_mask=self.ancestor_mask[:, :n, :n].contiguous())

    def to(self, device: torch.device) -> VerifyTree:
        """Copy every field to ``device`` (plain copies: the hot path stages a host tree
        through :mod:`structspec.staging` instead)."""
        return VerifyTree(
            **{
                name: getattr(self, name).to(device)
                for name in ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                             "ancestor_mask")
            }
        )


def _layout_kernel_applies(draft_tokens: torch.Tensor) -> bool:
    """Whether a device tree's layout is one Triton launch
    (:func:`structspec.kernels.draft_tree.tree_layout`) instead of ~``6 N`` torch ops: CUDA
    with the index kernels usable, int64 tokens, ``N`` within the kernel's tiles."""
    from structspec.kernels import index_kernels_usable

    if not (draft_tokens.is_cuda and index_kernels_usable(draft_tokens)):
        return False
    from structspec.kernels.draft_tree import MAX_NODES

    return draft_tokens.dtype == torch.int64 and draft_tokens.shape[1] <= MAX_NODES


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Parent index of every node from first-child / next-sibling links (host walk).

    Args:
        next_token, next_sibling: ``int64 [bs, N]`` CPU tensors.

    Returns:
        ``int64 [bs, N]``: -1 for the root; unlinked (padding) nodes get 0, as in
        :class:`~structspec.draft_tree.layout.VerifyTree`.
    """
    bs, n = next_token.shape
    out = [[0] * n for _ in range(bs)]
    for b, (nxt, sib) in enumerate(zip(next_token.tolist(), next_sibling.tolist(), strict=True)):
        out[b][0] = -1
        for p in range(n):
            c = nxt[p]
            while c != -1:
                out[b][c] = p
                c = sib[c]
    return torch.tensor(out, dtype=torch.int64).view(bs, n)
