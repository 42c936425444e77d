"""Drafter interface and registry: every speculative algorithm proposes a :class:`VerifyTree`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from structspec.spec.tree import VerifyTree


@dataclass
class DraftRequest:
    """What a drafter sees of one request: its id and every token so far.

    ``token_ids[-1]`` is the last committed token (node 0 of the tree); ``seq_len`` tokens of
    it have target KV in the cache.
    """

    request_id: str
    token_ids: list[int]
    seq_len: int


class Drafter(ABC):
    """Proposes draft trees. Capability flags tell the scheduler how to overlap work.

    Attributes:
        name: registry key (``--speculative-algorithm``).
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
        """Return ``[B, num_nodes]`` trees (host tensors if ``tree_on_host``, else device)."""

    def on_verified(self, reqs: Sequence[DraftRequest], committed: Sequence[list[int]]) -> None:  # noqa: B027
        """Hook after commit: ``committed[b]`` are the tokens request b kept this step."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """Forget a finished request's drafter state."""


class NoDrafter(Drafter):
    """Plain decoding: the tree is node 0 alone."""

    name = "none"
    tree_on_host = True
    supports_grammar_overlap = True

    def __init__(self, num_nodes: int = 1) -> None:
        super().__init__(1)

    def propose(self, reqs: Sequence[DraftRequest]) -> VerifyTree:
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.int64)
        return VerifyTree.root_only(last)


DRAFTERS: dict[str, Callable[..., Drafter]] = {"none": NoDrafter}


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    """Add a drafter factory under ``name`` (used by ``--speculative-algorithm``)."""
    DRAFTERS[name] = factory
