"""A prefill graph cache for the CPU (runner and engine tests of the graph path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structspec.runner.prefill_graph import PrefillGraph, PrefillGraphCache
from structspec.staging import Staging


class EagerPieces(PrefillGraphCache):
    """The prefill graph cache with each piece's recorded function run eagerly instead of
    replayed (the CPU has no graphs): everything else is the CUDA path's."""

    def _replay(self, staging: Staging, g: PrefillGraph, token_ids: Sequence[int],
                pages: Sequence[int], pos: int, real: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        g.fill(g.ints.numpy(), token_ids, pages, pos, real)
        return g.forward(self.model, self.kv_pool, self.page_size)
