"""The ``ngram_eagle`` drafter: an n-gram (prompt lookup) branch and EAGLE branches in one
verify tree.

Structured extraction mixes text copied from the prompt, which prompt lookup predicts far
ahead, with text the model writes itself, which only a learned drafter predicts. Each step,
per request:

1. the split (:class:`~structspec.speculative.branch_split.BranchSplit`) gives the n-gram
   branch ``g`` of the tree's ``N - 1`` draft nodes from each source's recent accepted tokens
   (the engine's averages at first; EAGLE re-probed with one node while its share rounds to
   none); all of them when EAGLE cannot draft the request yet (its target features have not
   arrived);
2. the n-gram drafter builds its full trie on the host
   (:meth:`~structspec.speculative.ngram.NgramDrafter.propose_lists`); its first ``g`` nodes
   (a tree: parents come first) are staged to the device with one non-blocking copy;
3. the EAGLE drafter proposes its full tree as always (its CUDA-graph replay is unchanged);
4. :func:`~structspec.speculative.tree_union.union_trees` merges the two on the device: EAGLE
   nodes on a path the trie already holds merge into the trie's nodes, and the slots the trie
   left go to the best-scored other EAGLE nodes;
5. after the commit the step's accepted drafts are credited: to the n-gram branch how far its
   full trie follows the committed run, to EAGLE the accepted drafts past the proposed trie
   (:func:`~structspec.speculative.branch_split.ngram_credit`).

The tree is a device tree like EAGLE's (``tree_on_host = False``): the grammar service copies
it to the host behind the draft kernels and builds its bitmask under the verify forward like
any other tree. Host work per step: the n-gram lookup and the EAGLE plan, both as their own
drafters do; no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.branch_split import BranchSplit, ngram_credit
from structspec.speculative.eagle import EagleDrafter, create_eagle_drafter
from structspec.speculative.ngram import NgramDrafter
from structspec.speculative.tree_union import union_trees
from structspec.staging import to_device


@dataclass
class _Proposed:
    """What a request's last propose offered, for crediting its accepted drafts.

    Attributes:
        trie_tokens, trie_parents: the n-gram drafter's full trie (root first).
        proposed: how many of its nodes (root included) went into the tree.
        eagle: EAGLE drafted the request (its tree had nodes to offer).
    """

    trie_tokens: list[int]
    trie_parents: list[int]
    proposed: int
    eagle: bool


class NgramEagleDrafter(Drafter):
    """n-gram trie + EAGLE tree in one verify tree (see the module doc).

    Args:
        spec: ``num_draft_tokens`` (N, node 0 included) and the n-gram and EAGLE settings.
        ngram: the n-gram drafter (its ``num_nodes`` must be N).
        eagle: the EAGLE drafter (its ``num_nodes`` must be N).
        split: the per-request node split (default: :class:`BranchSplit`'s).

    Raises:
        ValueError: a drafter's ``num_nodes`` differs from ``spec.num_draft_tokens``.
    """

    name = "ngram_eagle"
    tree_on_host = False
    supports_grammar_overlap = True

    def __init__(self, spec: SpecConfig, *, ngram: NgramDrafter, eagle: EagleDrafter,
                 split: BranchSplit | None = None) -> None:
        super().__init__(spec.num_draft_tokens)
        for what, d in (("ngram", ngram), ("eagle", eagle)):
            if d.num_nodes != self.num_nodes:
                raise ValueError(f"{what} drafter has {d.num_nodes} nodes, num_draft_tokens="
                                 f"{self.num_nodes}")
        self.ngram = ngram
        self.eagle = eagle
        self.split = split if split is not None else BranchSplit(
            start_ngram=float(self.num_nodes - 1))
        self.aux_hidden_layers = eagle.aux_hidden_layers
        self._proposed: dict[str, _Proposed] = {}

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """``[B, N]`` merged trees on EAGLE's device (see the module doc). No host sync: the
        trie goes up with one staged non-blocking copy, the merge is device ops."""
        n = self.num_nodes
        eagle = self.eagle
        ready = [eagle.ready(r, eagle.state(r.request_id), eagle.num_entries(r)) for r in reqs]
        budgets = [1 + (self.split.ngram_nodes(r.request_id, n - 1) if ok else n - 1)
                   for r, ok in zip(reqs, ready, strict=True)]
        tries = self.ngram.propose_lists(reqs, [n] * len(reqs))  # full: credited in full
        etree = eagle.propose(reqs)
        scores = eagle.last_node_scores
        assert scores is not None  # every propose sets it
        host = np.zeros((len(reqs), 2, n), dtype=np.int64)
        host[:, 0] = -1
        for b, ((toks, pars), req) in enumerate(zip(tries, reqs, strict=True)):
            g = min(budgets[b], len(toks))  # the trie's first g nodes are a tree
            host[b, 0, :g] = toks[:g]
            host[b, 1, :g] = pars[:g]
            self._proposed[req.request_id] = _Proposed(toks, pars, g, ready[b])
        staged = to_device(torch.from_numpy(host), eagle.device, eagle.staging)
        tokens, parents = union_trees(
            staged[:, 0], staged[:, 1], etree.draft_tokens, etree.parents, etree.depth, scores,
            max_depth=eagle.depth)
        return VerifyTree.from_parents(tokens, parents)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        """Credit each proposed request's accepted drafts to their source, then the two
        drafters' own hooks."""
        for req, run in zip(reqs, committed, strict=True):
            offered = self._proposed.pop(req.request_id, None)
            if offered is None or not run:
                continue
            accepted = run[:-1]  # the last committed token is the target's bonus
            g = offered.proposed
            on_trie = ngram_credit(offered.trie_tokens[:g], offered.trie_parents[:g], accepted)
            full = ngram_credit(offered.trie_tokens, offered.trie_parents, run)
            self.split.observe(req.request_id,
                               full if len(offered.trie_tokens) > 1 else None,
                               # EAGLE is measured only when it had a slot
                               len(accepted) - on_trie
                               if offered.eagle and g < self.num_nodes else None)
        self.ngram.on_verified(reqs, committed)
        self.eagle.on_verified(reqs, committed)

    def on_target_hidden(self, reqs: Sequence[DraftRequest], hidden_states: torch.Tensor,
                         rows: torch.Tensor | None, num_rows: Sequence[int],
                         aux_hidden_states: Sequence[torch.Tensor] = ()) -> None:
        """EAGLE's features (:meth:`EagleDrafter.on_target_hidden`)."""
        self.eagle.on_target_hidden(reqs, hidden_states, rows, num_rows, aux_hidden_states)

    def release(self, request_id: str) -> None:
        """Forget the request in both drafters and the split."""
        self.ngram.release(request_id)
        self.eagle.release(request_id)
        self.split.release(request_id)
        self._proposed.pop(request_id, None)

    def warmup_cuda_graphs(
        self, batch_sizes: Sequence[int] | None = None, kv_lens: Sequence[int] | None = None
    ) -> int:
        """EAGLE's propose graphs (:meth:`TreeDrafter.warmup_cuda_graphs`)."""
        return self.eagle.warmup_cuda_graphs(batch_sizes, kv_lens)


def create_ngram_eagle_drafter(
    spec: SpecConfig, *, target: Any, device: torch.device | str, dtype: torch.dtype,
    max_batch_size: int = 64, **context: Any,
) -> NgramEagleDrafter:
    """Registry factory of ``"ngram_eagle"`` (:mod:`structspec.speculative.registry`): the
    EAGLE head is read from ``spec.draft_model`` (the shipped head for the default model when
    none is given); the n-gram settings are ``spec.ngram_*``."""
    eagle = create_eagle_drafter(spec, target=target, device=device, dtype=dtype,
                                 max_batch_size=max_batch_size, **context)
    return NgramEagleDrafter(spec, ngram=NgramDrafter(spec), eagle=eagle)
