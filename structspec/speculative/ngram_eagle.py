"""The ``ngram_eagle`` drafter: an n-gram (prompt lookup) branch and EAGLE branches in one
verify tree.

Structured extraction mixes text copied from the prompt, which prompt lookup predicts far
ahead, with text the model writes itself, which only a learned drafter predicts. Each step,
per request:

1. the n-gram drafter builds its trie on the host, each node annotated with the suffix match
   length of the continuation that added it and how many continuations pass through it
   (:meth:`~structspec.speculative.ngram.NgramDrafter.annotated_tries`);
2. the n-gram branch's per-step confidence
   (:class:`~structspec.speculative.ngram_confidence.TrieConfidence`) turns those into a score
   per trie node (the estimated log-probability that the target accepts its path); tokens,
   parents and scores go to the device in one staged non-blocking copy;
3. the EAGLE drafter proposes its full tree as always (its CUDA-graph replay is unchanged),
   with each node's EAGLE-2 score;
4. :func:`~structspec.speculative.tree_union.union_trees` merges the two on the device: EAGLE
   nodes on a path the trie already holds merge into the trie's nodes, and the ``N - 1`` best
   scored nodes of both are kept. A trie from a long match keeps its nodes; where the trie is a
   guess (a short match), EAGLE's likelier nodes take its deeper slots; slots the trie leaves
   free go to EAGLE;
5. after the commit, the committed run updates the confidence estimates (every trie node the
   run tested, proposed or not).

The tree is a device tree like EAGLE's (``tree_on_host = False``): the grammar service copies
it to the host behind the draft kernels and builds its bitmask under the verify forward like
any other tree. Host work per step: the n-gram lookup and trie annotation, and the EAGLE plan;
no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from structspec.config import SpecConfig
from structspec.draft_tree.layout import VerifyTree
from structspec.speculative.base import Drafter, DraftRequest
from structspec.speculative.eagle import EagleDrafter, create_eagle_drafter
from structspec.speculative.ngram import AnnotatedTrie, NgramDrafter
from structspec.speculative.ngram_confidence import TrieConfidence
from structspec.speculative.tree_union import union_trees
from structspec.staging import to_device

#: fixed-point scale of the trie scores staged with the trie's int64 tokens and parents
#: (one copy; a log-probability is exact to 1e-6)
SCORE_SCALE = 1_000_000
#: the staged score of a padding node (far below any real one; it is masked anyway)
PAD_SCORE = -(10**15)


class NgramEagleDrafter(Drafter):
    """n-gram trie + EAGLE tree in one verify tree (see the module doc).

    Args:
        spec: ``num_draft_tokens`` (N, node 0 included) and the n-gram and EAGLE settings.
        ngram: the n-gram drafter (its ``num_nodes`` must be N).
        eagle: the EAGLE drafter (its ``num_nodes`` must be N).
        confidence: the trie node estimates (default: :class:`TrieConfidence` with the
            n-gram drafter's ``max_window``).

    Raises:
        ValueError: a drafter's ``num_nodes`` differs from ``spec.num_draft_tokens``.
    """

    name = "ngram_eagle"
    tree_on_host = False
    supports_grammar_overlap = True

    def __init__(self, spec: SpecConfig, *, ngram: NgramDrafter, eagle: EagleDrafter,
                 confidence: TrieConfidence | None = None) -> None:
        super().__init__(spec.num_draft_tokens)
        for what, d in (("ngram", ngram), ("eagle", eagle)):
            if d.num_nodes != self.num_nodes:
                raise ValueError(f"{what} drafter has {d.num_nodes} nodes, num_draft_tokens="
                                 f"{self.num_nodes}")
        self.ngram = ngram
        self.eagle = eagle
        # the merge ranks EAGLE's nodes by their scores (set before any propose graph is
        # captured: the graphs record the scores only for such a drafter)
        eagle.keeps_node_scores = True
        self.confidence = confidence if confidence is not None else TrieConfidence(
            max_match=ngram.max_window)
        self.aux_hidden_layers = eagle.aux_hidden_layers
        self._proposed: dict[str, AnnotatedTrie] = {}

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """``[B, N]`` merged trees on EAGLE's device (see the module doc). No host sync: the
        trie and its scores go up with one staged non-blocking copy, the merge is device
        ops."""
        return self._propose(reqs, self.num_nodes)

    def propose_sized(self, reqs: Sequence[DraftRequest], max_nodes: int) -> VerifyTree:
        """:meth:`propose` for a verify that keeps only the first ``max_nodes`` nodes (the
        adaptive tree sizer's plan): EAGLE's :meth:`~structspec.speculative.tree_drafter.
        TreeDrafter.propose_sized` runs only the expansion depths such a tree can use (a
        2-node probe: its catch-up forward alone), then the merge as in :meth:`propose`. The
        merged tree is in rank order, so the kept prefix is its best ``max_nodes - 1`` nodes
        and a tree (:func:`~structspec.speculative.tree_union.union_trees`)."""
        return self._propose(reqs, max_nodes)

    def _propose(self, reqs: Sequence[DraftRequest], max_nodes: int) -> VerifyTree:
        """:meth:`propose` with EAGLE's tree sized for a verify of ``max_nodes`` nodes (the
        trie is built whole: its host cost does not grow with the tree)."""
        n = self.num_nodes
        eagle = self.eagle
        tries = self.ngram.annotated_tries(reqs)
        etree = (eagle.propose(reqs) if max_nodes >= n
                 else eagle.propose_sized(reqs, max_nodes))
        scores = eagle.last_node_scores
        assert scores is not None  # every propose sets it
        # [3, B, N] int64: tokens | parents | fixed-point scores, built as Python lists and
        # converted once (per-request numpy slice writes cost ~5 numpy calls a request)
        rows: list[list[list[int]]] = [[], [], []]
        for trie, req in zip(tries, reqs, strict=True):
            pad = n - len(trie.tokens)  # >= 0: the trie's budget is the tree's
            rows[0].append(trie.tokens + [-1] * pad)
            rows[1].append(trie.parents + [0] * pad)
            rows[2].append([round(x * SCORE_SCALE) for x in self.confidence.path_logp(trie)]
                           + [PAD_SCORE] * pad)
            self._proposed[req.request_id] = trie
        host = np.array(rows, dtype=np.int64).reshape(3, len(reqs), n)
        # eager device ops: replayed through a KeyedGraphs graph, the merge measured slower
        # on the H200 (MaskBench batch 1: 402 against 733 tok/s; batch 64 did not finish in
        # 150 s; benchmarks/README.md), so it stays eager until that is understood
        return self._merge(etree.draft_tokens, etree.parents, etree.depth, scores,
                           to_device(torch.from_numpy(host), eagle.device, eagle.staging))

    def _merge(self, eagle_tokens: torch.Tensor, eagle_parents: torch.Tensor,
               eagle_depth: torch.Tensor, eagle_scores: torch.Tensor,
               trie: torch.Tensor) -> VerifyTree:
        """The merged device tree of EAGLE's ``[B, N]`` tree and scores and the staged
        ``[3, B, N]`` int64 trie (tokens | parents | fixed-point scores); device ops only (no
        host sync: graph-capturable)."""
        tokens, parents = union_trees(
            trie[0], trie[1], trie[2].float() / SCORE_SCALE, eagle_tokens, eagle_parents,
            eagle_depth, eagle_scores, max_depth=self.eagle.depth)
        return VerifyTree.from_parents(tokens, parents)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        """Update the trie confidence from each proposed request's committed run, then the two
        drafters' own hooks."""
        for req, run in zip(reqs, committed, strict=True):
            trie = self._proposed.pop(req.request_id, None)
            if trie is not None and run:
                self.confidence.observe(trie, run)
        self.ngram.on_verified(reqs, committed)
        self.eagle.on_verified(reqs, committed)

    def on_target_hidden(self, reqs: Sequence[DraftRequest], hidden_states: torch.Tensor,
                         rows: torch.Tensor | None, num_rows: Sequence[int] | None,
                         aux_hidden_states: Sequence[torch.Tensor] = ()) -> None:
        """EAGLE's features (:meth:`EagleDrafter.on_target_hidden`)."""
        self.eagle.on_target_hidden(reqs, hidden_states, rows, num_rows, aux_hidden_states)

    def commit_target_hidden(self, reqs: Sequence[DraftRequest],
                             num_rows: Sequence[int]) -> None:
        """EAGLE's run lengths (:meth:`EagleDrafter.commit_target_hidden`)."""
        self.eagle.commit_target_hidden(reqs, num_rows)

    def release(self, request_id: str) -> None:
        """Forget the request in both drafters."""
        self.ngram.release(request_id)
        self.eagle.release(request_id)
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
    # the merged tree's trie branch reaches N - 1 drafts (EAGLE's own nodes only ``depth``):
    # EAGLE's catch-up width covers the longest run, so its propose stays one graph replay
    eagle = create_eagle_drafter(spec, target=target, device=device, dtype=dtype,
                                 max_batch_size=max_batch_size,
                                 max_accept_drafts=max(spec.depth, spec.num_draft_tokens - 1),
                                 **context)
    return NgramEagleDrafter(spec, ngram=NgramDrafter(spec), eagle=eagle)
