"""Draft-model drafter: a smaller causal LM with the target's tokenizer proposes an EAGLE-2 tree.

Speculative decoding with a separate draft model (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al., 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"), drafting a dynamic tree as in EAGLE-2 (Li et al., 2024,
arXiv:2406.16858). The expansion (:mod:`structspec.speculative.expansion`), the draft KV
bookkeeping (:mod:`structspec.speculative.tree_drafter`) and the batched forwards
(:mod:`structspec.speculative.draft_batches`) are shared with EAGLE; this module only says what
a committed entry is (one per history token: entry ``p`` holds the draft KV of
``token_ids[p]``) and runs the draft model.

Per propose there are ``1 + (depth - 1)`` batched draft forwards (two catch-up forwards when a
request is seen for the first time next to running ones): a causal catch-up over the tokens
committed since the last propose (the whole history on first sight; always at least the last
token, whose logits give the root's children), then one tree forward per expansion step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from structspec.config import SpecConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.speculative.base import DraftRequest
from structspec.speculative.tree_drafter import (
    TreeDrafter,
    default_draft_pages,
    target_graph_options,
)


class DraftModelDrafter(TreeDrafter):
    """EAGLE-2 tree drafting with an independent small model and its own paged KV cache.

    Args:
        spec: ``draft_model`` (path of the draft checkpoint, loaded with
            :func:`structspec.models.loader.load_model`), ``num_draft_tokens``, ``depth``,
            ``topk``.
        target: the target :class:`~structspec.runner.model_runner.ModelRunner` (page size and
            pool size are copied from it; its vocabulary must be that of the draft model).
        device: where the draft model and its KV pool live.
        dtype: draft model and KV dtype.
        num_pages: draft KV pool pages; default: the target pool's pages plus
            ``max_batch_size`` requests' scratch pages.
        max_batch_size: used only for the default ``num_pages``.
        model: an already loaded ``(model, ModelConfig)`` pair instead of ``spec.draft_model``
            (tests, or sharing weights).
        load_format: how ``spec.draft_model`` is loaded: ``"auto"`` reads its weights,
            ``"dummy"`` builds seeded random weights from its config.json (see
            :func:`structspec.models.loader.load_model`; with the target's own directory and
            seed the draft then equals the target).
        seed: the ``dummy`` seed.
        use_cuda_graph: replay proposes from CUDA graphs (CUDA only, and only when the target
            uses graphs too; see :func:`~structspec.speculative.tree_drafter.target_graph_options`).
        cuda_graph_batch_sizes: graph batch buckets (default: the target's).

    Raises:
        ValueError: no ``spec.draft_model`` path, or the vocabularies differ.
    """

    name = "draft_model"

    def __init__(
        self,
        spec: SpecConfig,
        *,
        target: Any,
        device: torch.device | str,
        dtype: torch.dtype,
        num_pages: int | None = None,
        max_batch_size: int = 64,
        model: tuple[torch.nn.Module, Any] | None = None,
        load_format: str = "auto",
        seed: int = 0,
        use_cuda_graph: bool = True,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
    ) -> None:
        device = torch.device(device)
        if model is None:
            if not spec.draft_model:
                raise ValueError("speculative_algorithm='draft_model' needs draft_model=PATH")
            from structspec.models.loader import load_model

            model = load_model(spec.draft_model, device=device, dtype=dtype,
                               load_format=load_format, seed=seed)
        self.model, self.model_config = model
        kernels = getattr(target, "kernels", None)
        if kernels is not None and hasattr(self.model, "set_kernels"):
            self.model.set_kernels(kernels)  # the target's choice of fused kernels
        target_vocab = int(target.model_config.vocab_size)
        if self.model_config.vocab_size != target_vocab:
            raise ValueError(
                f"draft model vocab_size {self.model_config.vocab_size} != target vocab_size "
                f"{target_vocab}; the draft model must share the target's tokenizer"
            )
        page_size = int(target.page_size)
        if num_pages is None:
            num_pages = default_draft_pages(spec, target, max_batch_size)
        pool = KVPool(
            num_layers=self.model_config.num_hidden_layers, num_pages=num_pages,
            page_size=page_size, num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim, dtype=dtype, device=device,
        )
        super().__init__(spec, pool, device=device,
                         **target_graph_options(target, use_cuda_graph, cuda_graph_batch_sizes))

    def num_entries(self, req: DraftRequest) -> int:
        """One entry per history token: ``len(token_ids)``."""
        return len(req.token_ids)

    def entry_tokens(self, req: DraftRequest, start: int, end: int) -> list[int]:
        """Entry p's input token is ``token_ids[p]``."""
        return list(req.token_ids[start:end])

    def extend_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal catch-up; returns the last rows' ``[b, V]`` float32 log-probs, no state."""
        out = self.model(fb, self.kv_pool)
        hidden = out.hidden_states.reshape(-1, out.hidden_states.shape[-1])
        assert fb.logits_indices is not None
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        return torch.log_softmax(logits, dim=-1), None

    def step_forward(
        self, fb: ForwardBatch, parent: torch.Tensor, root_state: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        """Tree forward over the frontier ``[B, k]``; returns ``[B, k, V]`` float32 log-probs."""
        out = self.model(fb, self.kv_pool)
        h = out.hidden_states
        logits = self.model.compute_logits(h.reshape(-1, h.shape[-1]))
        return torch.log_softmax(logits, dim=-1).view(h.shape[0], h.shape[1], -1)


def create_draft_model_drafter(
    spec: SpecConfig, *, target: Any, device: torch.device | str, dtype: torch.dtype,
    max_batch_size: int = 64, load_format: str = "auto", seed: int = 0, **context: Any,
) -> DraftModelDrafter:
    """Registry factory of ``"draft_model"`` (:mod:`structspec.speculative.registry`): the
    draft model at ``spec.draft_model`` is loaded like the target (the engine's
    ``load_format`` and ``seed``); other ``context`` keywords are ignored."""
    return DraftModelDrafter(spec, target=target, device=device, dtype=dtype,
                             max_batch_size=max_batch_size, load_format=load_format, seed=seed)
