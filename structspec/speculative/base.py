"""Drafter interface: every speculative algorithm proposes a :class:`VerifyTree`.

A drafter subclasses :class:`Drafter` and is registered by name in
:mod:`structspec.speculative.registry`. The optional hooks (target features, commit
notifications, graph warm-up) are no-op methods here, so the scheduler and the benchmarks call
them on every drafter without looking them up.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from structspec.draft_tree.layout import VerifyTree


class TokenHistory(Sequence[int]):
    """``prompt + output[:len(output) at construction]`` as one read-only sequence, without
    copying either list.

    The scheduler hands every running request's history to the drafter each verify step;
    concatenating them cost ~0.5 ms per step at batch 64 with 1.5k-token histories (2-core
    CPU), on the path between a step's result and the next launch, while the drafters read
    only the tail (n-gram: the tokens since its last look; draft model / EAGLE: the catch-up
    range). Indexing and slicing return plain ints and lists; ``np.asarray`` builds the array
    in two copies.

    The view is valid while the output ids are only appended to (it keeps its length); the
    scheduler builds it right before ``propose`` and a drafter must not keep it past that
    step (the grammar barrier or a stop cut may later drop ids from the output list).
    """

    __slots__ = ("_prompt", "_output", "_num_output")

    def __init__(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self._prompt = prompt_ids
        self._output = output_ids
        self._num_output = len(output_ids)

    def __len__(self) -> int:
        return len(self._prompt) + self._num_output

    def __getitem__(self, index: int | slice) -> Any:
        p = len(self._prompt)
        n = p + self._num_output
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return list(self)[index]
            if start >= p:
                return self._output[start - p : max(start, stop) - p]
            if stop <= p:
                return self._prompt[start:stop]
            return self._prompt[start:] + self._output[: stop - p]
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"token index {index} out of range for a history of {n}")
        return self._prompt[i] if i < p else self._output[i - p]

    def __iter__(self) -> Iterator[int]:
        yield from self._prompt
        yield from itertools.islice(self._output, self._num_output)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenHistory, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable underneath, like a list

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        p = len(self._prompt)
        out = np.empty(len(self), dtype=dtype or np.int64)
        out[:p] = self._prompt
        out[p:] = self._output[: self._num_output]
        return out

    def __repr__(self) -> str:
        return f"TokenHistory({len(self._prompt)} prompt + {self._num_output} output ids)"


@dataclass
class DraftRequest:
    """What a drafter sees of one request: its id and every token so far.

    ``token_ids[-1]`` is the last committed token (node 0 of the tree); ``seq_len`` tokens of
    it have target KV in the cache. ``token_ids`` is a list or a :class:`TokenHistory` (the
    scheduler's, valid for the step's ``propose``).
    """

    request_id: str
    token_ids: Sequence[int]
    seq_len: int


class Drafter(ABC):
    """Proposes draft trees. Capability flags tell the scheduler how to overlap work.

    Subclasses implement :meth:`propose` and may override the optional hooks
    (:attr:`aux_hidden_layers`, :meth:`on_target_hidden`, :meth:`on_verified`,
    :meth:`release`, :meth:`warmup_cuda_graphs`), which do nothing here.

    Attributes:
        name: registry key (``--speculative-algorithm``).
        num_nodes: ``N``, nodes per proposed tree, node 0 (the last committed token) included.
        tree_on_host: the tree is built on the CPU before the verify launch (ngram, none), so
            its grammar bitmask can be built without a device-to-host copy.
        supports_grammar_overlap: the grammar mask for this drafter's tree may be built while the
            verify forward runs.
    """

    name: ClassVar[str]
    tree_on_host: ClassVar[bool]
    supports_grammar_overlap: ClassVar[bool]

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes

    @abstractmethod
    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Draft one tree per request.

        Args:
            reqs: the ``B`` running requests of this verify step (their histories are valid
                for this call only, see :class:`TokenHistory`).

        Returns:
            ``[B, num_nodes]`` trees: int64 CPU tensors if ``tree_on_host``, else on the model
            device. Node 0 of row b is ``reqs[b].token_ids[-1]``; unused nodes are padding
            (token -1).
        """

    def propose_sized(self, reqs: Sequence[DraftRequest], max_nodes: int) -> VerifyTree:
        """Draft trees of which the verify keeps only the first ``max_nodes`` nodes (the
        adaptive tree sizer's plan, ``2 <= max_nodes < num_nodes``; the scheduler cuts the
        nodes past it).

        A drafter whose cost grows with the tree may do less work: the model drafters
        (:class:`~structspec.speculative.tree_drafter.TreeDrafter`) run only the expansion
        depths a tree of ``max_nodes`` nodes can use. The result has :meth:`propose`'s shape
        ``[B, num_nodes]`` (nodes past ``max_nodes`` may be padding). Default: :meth:`propose`.
        """
        return self.propose(reqs)

    #: target decoder layers whose outputs this drafter reads (EAGLE-3 features); the target
    #: forwards return them as ``aux_hidden_states``. Empty: none.
    aux_hidden_layers: tuple[int, ...] = ()

    def on_target_hidden(  # noqa: B027
        self,
        reqs: Sequence[DraftRequest],
        hidden_states: torch.Tensor,
        rows: torch.Tensor | None,
        num_rows: Sequence[int] | None,
        aux_hidden_states: Sequence[torch.Tensor] = (),
    ) -> None:
        """Hook after every target forward (prefill and verify) with its hidden states, for
        drafters that read target features (EAGLE); a no-op by default.

        Args:
            reqs: the forward's requests (after a prefill: ``DraftRequest(id, prompt, 0)``).
            hidden_states: ``[B, Q, H]`` final target hidden states (device).
            rows: ``[B, R]`` int64 query row per newly committed position (device), or None
                (row j = position j, after a prefill).
            num_rows: host ints, valid entries of ``rows[b]`` (the committed run lengths);
                None after a verify whose results have not reached the host yet: store what
                every column of ``rows`` would give, and count it once
                :meth:`commit_target_hidden` brings the run lengths.
            aux_hidden_states: the outputs of :attr:`aux_hidden_layers`, each ``[B, Q, H]``.
        """

    def commit_target_hidden(  # noqa: B027
        self, reqs: Sequence[DraftRequest], num_rows: Sequence[int]
    ) -> None:
        """The committed run lengths (host ints) of the verify whose features
        :meth:`on_target_hidden` got with ``num_rows=None``; a no-op by default."""

    def on_verified(  # noqa: B027
        self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]
    ) -> None:
        """Hook after commit: ``committed[b]`` are the tokens request b kept this step (host
        ints: accepted drafts then the bonus token); a no-op by default."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """Forget a finished request's drafter state; a no-op by default."""

    def warmup_cuda_graphs(
        self, batch_sizes: Sequence[int] | None = None, kv_lens: Sequence[int] | None = None
    ) -> int:
        """Capture the drafter's own CUDA graphs ahead of time (before timing); drafters
        without graphs capture nothing.

        Args:
            batch_sizes: batch sizes to capture the buckets of (default: all).
            kv_lens: committed lengths to capture the buckets of (default: all).

        Returns:
            The number of graphs captured by this call (0 here).
        """
        return 0


class NoDrafter(Drafter):
    """Plain decoding: the tree is node 0 alone."""

    name = "none"
    tree_on_host = True
    supports_grammar_overlap = True

    def __init__(self, num_nodes: int = 1) -> None:
        super().__init__(1)

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        """Host ``[B, 1]`` trees of the last committed tokens (int64, CPU)."""
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.int64)
        return VerifyTree.root_only(last)


def create_no_drafter(spec: Any, **context: Any) -> NoDrafter:
    """Registry factory of ``"none"`` (:mod:`structspec.speculative.registry`): needs neither
    the spec nor the engine ``context``."""
    return NoDrafter()
