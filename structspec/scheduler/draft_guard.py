"""Drafter failures stay local: a drafter that raises costs speed, never a request.

A drafter only proposes; the target verifies every token it proposes, so what the engine
commits never depends on the drafter (docs/architecture.md, invariant 2). When a drafter raises
(in :meth:`~structspec.speculative.base.Drafter.propose` or a hook) or returns a tree of the
wrong shape, :class:`GuardedDrafter`:

- finds the requests it fails on: a failed batched ``propose`` is retried once per request of
  the batch (a request-specific fault then stays with its request; a hook changes the
  drafter's state, so a failed hook is not retried and all requests of its call count as
  failed);
- runs the step without speculation for the failed requests: their rows of the tree are the
  root alone (padded to the drafter's ``N`` nodes, so the runner's shapes and graphs stay), so
  each commits exactly the target's next token, the token it would commit with any draft;
- stops speculating for them until they finish (they are released from the drafter): after a
  failure its state for them (a draft model's KV, EAGLE's features) is no longer known to
  match their committed tokens, and a request-specific fault would only raise again. The
  other requests, and those admitted later, speculate as before;
- after :data:`MAX_DRAFTER_FAILURES` steps with a failure switches speculation off for the
  engine's life (a drafter that fails on every request would otherwise cost a failed call per
  new request).

No request fails and no output changes (greedy; with sampling the distribution is the target's
either way). Each failure is logged with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from structspec.draft_tree.layout import VerifyTree
from structspec.scheduler.tree_fit import tree_to_device
from structspec.speculative.base import Drafter, DraftRequest
from structspec.staging import Staging, to_device

logger = logging.getLogger(__name__)

#: steps with a drafter failure after which the engine stops calling the drafter at all
MAX_DRAFTER_FAILURES = 3

_TREE_FIELDS = ("draft_tokens", "parents", "depth", "next_token", "next_sibling",
                "ancestor_mask")


def root_only_padded(last_tokens: torch.Tensor, num_nodes: int) -> VerifyTree:
    """Plain-decoding trees in a drafter's shape: node 0 is the last committed token, the other
    ``num_nodes - 1`` nodes are padding (token -1), so no draft can be accepted.

    Args:
        last_tokens: ``[B]`` int64 host tensor.
        num_nodes: ``N`` (>= 1).

    Returns:
        A host :class:`VerifyTree` of shape ``[B, N]``.
    """
    bsz = last_tokens.shape[0]
    tokens = torch.full((bsz, num_nodes), -1, dtype=torch.int64)
    tokens[:, 0] = last_tokens
    return VerifyTree.from_parents(tokens, torch.zeros_like(tokens))


class GuardedDrafter:
    """The scheduler's view of its drafter: the same calls, with failures contained (module
    doc); ``num_nodes``, ``tree_on_host`` and ``supports_grammar_overlap`` are the drafter's.

    Args:
        drafter: the engine's drafter.
        device: the model device (where a device drafter's trees live).
        staging: the runner's pinned staging (CUDA): the root-only rows and row indices that
            go to the device in a mixed step travel through it (``non_blocking``, no host
            sync; docs/architecture.md, invariant 6); None on CPU.
    """

    def __init__(self, drafter: Drafter, device: torch.device,
                 staging: Staging | None = None) -> None:
        self.drafter = drafter
        self._device = device
        self._staging = staging
        #: requests that no longer speculate (their drafter failed on them)
        self.stopped: set[str] = set()
        #: steps (or hook calls) in which the drafter failed
        self.num_failures = 0
        #: speculation is off for the engine (too many failures)
        self.disabled = False
        #: the node budget of the propose in progress (``propose(..., max_nodes=)``)
        self._max_nodes: int | None = None

    @property
    def num_nodes(self) -> int:
        """The drafter's ``N`` (every tree has it, speculating or not)."""
        return self.drafter.num_nodes

    @property
    def tree_on_host(self) -> bool:
        """Whether the drafter's trees are built on the host (:class:`Drafter`)."""
        return self.drafter.tree_on_host

    @property
    def supports_grammar_overlap(self) -> bool:
        """Whether the mask may be built under the verify forward (:class:`Drafter`)."""
        return self.drafter.supports_grammar_overlap

    def _speculating(self, reqs: Sequence[DraftRequest]) -> list[int]:
        if self.disabled:
            return []
        if not self.stopped:  # the common case: one range, no per-request lookups
            return list(range(len(reqs)))
        return [i for i, r in enumerate(reqs) if r.request_id not in self.stopped]

    def _fail(self, what: str, reqs: Sequence[DraftRequest], error: BaseException,
              *, count: bool = True) -> None:
        """Stop speculating for ``reqs``; ``count``: count a failure (speculation goes off for
        all after too many)."""
        if count:
            self.num_failures += 1
            if self.num_failures >= MAX_DRAFTER_FAILURES:
                self.disabled = True
        logger.error("drafter %r failed in %s for %d request(s) (%s); they continue without "
                     "speculation%s", getattr(self.drafter, "name", "?"), what, len(reqs),
                     error, "; speculation is now off for this engine" if self.disabled else "",
                     exc_info=error)
        for r in reqs:
            self.stopped.add(r.request_id)
            self._release(r.request_id)

    def _release(self, request_id: str) -> None:
        try:
            self.drafter.release(request_id)
        except Exception as e:  # noqa: BLE001 - a release failure must not stop the engine
            logger.error("drafter %r failed to release request %s: %s",
                         getattr(self.drafter, "name", "?"), request_id, e)

    def propose(self, reqs: Sequence[DraftRequest], *,
                max_nodes: int | None = None) -> VerifyTree:
        """The drafter's trees for the speculating requests, root-only rows for the others
        (and for all of them when the drafter raises or returns a wrong shape).

        Args:
            reqs: the requests to draft for.
            max_nodes: the verify keeps only this many nodes of each tree (the tree sizer's
                plan): the drafter's :meth:`~structspec.speculative.base.Drafter.propose_sized`
                runs; None or ``>= num_nodes``: its :meth:`propose`.
        """
        live = self._speculating(reqs)
        if not live:
            return self._plain(reqs)
        self._max_nodes = max_nodes
        sub = reqs if len(live) == len(reqs) else [reqs[i] for i in live]
        try:
            tree = self._checked_propose(sub)
        except Exception as e:  # noqa: BLE001 - contained: see the module doc
            self.num_failures += 1  # one per step, however many requests fail in it
            if self.num_failures >= MAX_DRAFTER_FAILURES:
                self.disabled = True
            if len(sub) == 1 or self.disabled:
                self._fail("propose", sub, e, count=False)
                return self._plain(reqs)
            return self._propose_one_by_one(reqs, live)
        if len(live) == len(reqs):
            return tree
        return self._merge(reqs, [(live, tree)])

    def _checked_propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """``drafter.propose(reqs)`` (``propose_sized`` under a smaller node budget); a tree of
        the wrong shape raises ValueError."""
        n = self._max_nodes
        if n is not None and n < self.drafter.num_nodes:
            tree = self.drafter.propose_sized(reqs, n)
        else:
            tree = self.drafter.propose(reqs)
        expected = (len(reqs), self.drafter.num_nodes)
        if tuple(tree.draft_tokens.shape) != expected:
            raise ValueError(f"propose returned trees of shape "
                             f"{tuple(tree.draft_tokens.shape)}, expected {expected}")
        return tree

    def _propose_one_by_one(self, reqs: Sequence[DraftRequest], live: list[int]) -> VerifyTree:
        """After a failed batched propose: each speculating request alone; those that fail
        stop speculating, the others keep their trees this very step."""
        parts: list[tuple[list[int], VerifyTree]] = []
        for i in live:
            try:
                parts.append(([i], self._checked_propose([reqs[i]])))
            except Exception as e:  # noqa: BLE001 - contained: see the module doc
                self._fail("propose", [reqs[i]], e, count=False)
        return self._merge(reqs, parts)

    def _plain(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Root-only padded trees for every row, where the drafter's trees would be."""
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.int64)
        tree = root_only_padded(last, self.drafter.num_nodes)
        if self.drafter.tree_on_host:
            return tree
        return tree_to_device(tree, self._device, self._staging)

    def _merge(self, reqs: Sequence[DraftRequest],
               parts: Sequence[tuple[list[int], VerifyTree]]) -> VerifyTree:
        """Per part, the drafter's trees for those batch rows; root-only rows elsewhere (host
        values reach a device tree through the pinned staging, no host sync)."""
        full = self._plain(reqs)
        for rows, tree in parts:
            if full.device != tree.device:
                full = tree_to_device(full, tree.device, self._staging)
            idx = self._index(rows, tree.device)
            for name in _TREE_FIELDS:
                getattr(full, name)[idx] = getattr(tree, name)
        return full

    def _index(self, rows: Sequence[int], device: torch.device) -> torch.Tensor:
        """``rows`` as an int64 index tensor on ``device`` (staged: no host sync). A host
        drafter's trees merge on the host, and its index stays there: the staging ring puts
        what it is given on the model's device, and indexing host trees with that copies it
        back, a blocking sync every step a request's drafting is stopped."""
        host = torch.tensor(list(rows), dtype=torch.int64)
        if device.type == "cpu" and self.drafter.tree_on_host:
            return host
        return to_device(host, device, self._staging)

    def on_target_hidden(self, reqs: Sequence[DraftRequest], hidden_states: torch.Tensor,
                         rows: torch.Tensor | None, num_rows: Sequence[int] | None,
                         aux_hidden_states: Sequence[torch.Tensor] = ()) -> None:
        """:meth:`Drafter.on_target_hidden` for the speculating requests (their rows of the
        batch tensors)."""
        live = self._speculating(reqs)
        if not live:
            return
        if len(live) < len(reqs):
            idx = self._index(live, hidden_states.device)
            reqs = [reqs[i] for i in live]
            hidden_states = hidden_states[idx]
            rows = None if rows is None else rows[idx.to(rows.device)]
            num_rows = None if num_rows is None else [num_rows[i] for i in live]
            aux_hidden_states = [a[idx] for a in aux_hidden_states]
        try:
            self.drafter.on_target_hidden(reqs, hidden_states, rows, num_rows,
                                          aux_hidden_states)
        except Exception as e:  # noqa: BLE001 - contained: see the module doc
            self._fail("on_target_hidden", reqs, e)

    def commit_target_hidden(self, reqs: Sequence[DraftRequest],
                             num_rows: Sequence[int]) -> None:
        """:meth:`Drafter.commit_target_hidden` for the speculating requests."""
        live = self._speculating(reqs)
        if not live:
            return
        try:
            self.drafter.commit_target_hidden([reqs[i] for i in live],
                                              [num_rows[i] for i in live])
        except Exception as e:  # noqa: BLE001 - contained: see the module doc
            self._fail("commit_target_hidden", [reqs[i] for i in live], e)

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:
        """:meth:`Drafter.on_verified` for the speculating requests."""
        live = self._speculating(reqs)
        if not live:
            return
        if len(live) < len(reqs):
            reqs = [reqs[i] for i in live]
            committed = [committed[i] for i in live]
        try:
            self.drafter.on_verified(reqs, committed)
        except Exception as e:  # noqa: BLE001 - contained: see the module doc
            self._fail("on_verified", reqs, e)

    def stop(self, request_id: str) -> None:
        """Stop speculating for a request that is ending (e.g. its logits were not finite):
        it is released now and skipped by the hooks."""
        if request_id not in self.stopped:
            self.stopped.add(request_id)
            self._release(request_id)

    def reset(self, request_id: str) -> None:
        """Drop a preempted request's drafter state (its draft KV, features, n-gram index):
        the drafter rebuilds it from the history when the request runs again. A request the
        guard stopped stays stopped (its state is gone already)."""
        if request_id not in self.stopped:
            self._release(request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request (the drafter's state, unless already released)."""
        if request_id in self.stopped:
            self.stopped.discard(request_id)
            return
        self._release(request_id)
