"""ModelRunner: owns the target model and its KV pool; runs prefill and tree-verify forwards.

Inputs are host-side descriptions (token lists, page lists, a verify tree); outputs stay on the
device until the scheduler copies what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from structspec.config import CacheConfig, ModelConfig
from structspec.engine.batch_builder import (
    accepted_kv_moves,
    build_prefill_batch,
    build_verify_batch,
    page_table_tensor,
)
from structspec.kvcache.pool import KVPool
from structspec.spec.tree import VerifyTree
from structspec.spec.verify import VerifyResult


@dataclass
class VerifyForwardOutput:
    """What a verify forward leaves on the device.

    Attributes:
        logits: ``[B * N, V]`` float32, row ``b * N + i`` = node i of request b.
        seq_lens: ``[B]`` int64 committed lengths the forward ran with.
        page_table: ``[B, P]`` int64 pages it wrote through.
        hidden_states: ``[B, N, H]`` final hidden states (EAGLE drafters read them).
        aux_hidden_states: outputs of ``ModelRunner.aux_hidden_layers``, each ``[B, N, H]``.
    """

    logits: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor]


@dataclass
class PrefillOutput:
    """What a prefill forward leaves on the device.

    Attributes:
        logits: ``[B, V]`` float32 logits of each request's last prompt token.
        hidden_states: ``[B, Q, H]`` final hidden states of every (padded) prompt position.
        aux_hidden_states: outputs of ``ModelRunner.aux_hidden_layers``, each ``[B, Q, H]``.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor]


class ModelRunner:
    """Runs the target model's forwards over the paged KV pool.

    Args:
        model: a model from :mod:`structspec.models` (already on ``device``, in ``dtype``).
        model_config: its architecture.
        cache_config: KV pool sizing.
        device: where the model and the pool live.
        dtype: KV-cache dtype (the model's).
    """

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.page_size = cache_config.page_size
        self.kv_pool = KVPool(
            num_layers=model_config.num_hidden_layers,
            num_pages=cache_config.total_pages,
            page_size=cache_config.page_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        #: decoder layers whose outputs drafters need (EAGLE-3 features); () = none.
        self.aux_hidden_layers: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        """Width of the logits rows (may exceed the tokenizer's vocabulary)."""
        return self.model_config.vocab_size

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[Sequence[int]], pages: Sequence[Sequence[int]]
    ) -> PrefillOutput:
        """Write the prompts' KV; return the last prompt tokens' logits and hidden states."""
        fb = build_prefill_batch(token_ids, pages, page_size=self.page_size, device=self.device)
        out = self.model(fb, self.kv_pool, aux_hidden_layers=self.aux_hidden_layers)
        hidden = out.hidden_states.reshape(-1, out.hidden_states.shape[-1])
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        return PrefillOutput(logits=logits, hidden_states=out.hidden_states,
                             aux_hidden_states=list(out.aux_hidden_states))

    @torch.inference_mode()
    def verify(
        self, tree: VerifyTree, seq_lens: Sequence[int], pages: Sequence[Sequence[int]]
    ) -> VerifyForwardOutput:
        """Run the target over every node of every tree (one forward).

        Args:
            tree: the batch's verify trees on ``self.device``.
            seq_lens: committed KV length per request (host ints).
            pages: per request, pages covering at least ``seq_len + N`` positions.
        """
        n = tree.num_nodes
        need = -(-(max(seq_lens) + n) // self.page_size)
        table = page_table_tensor([p[:need] for p in pages], self.device)
        seq_lens_t = torch.tensor(list(seq_lens), dtype=torch.int64).to(self.device)
        fb = build_verify_batch(tree, seq_lens_t, table, page_size=self.page_size)
        out = self.model(fb, self.kv_pool, aux_hidden_layers=self.aux_hidden_layers)
        hidden = out.hidden_states
        logits = self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return VerifyForwardOutput(logits=logits, seq_lens=seq_lens_t, page_table=table,
                                   hidden_states=hidden,
                                   aux_hidden_states=list(out.aux_hidden_states))

    @torch.inference_mode()
    def commit_accepted_kv(self, fwd: VerifyForwardOutput, result: VerifyResult) -> None:
        """Move each accepted path's KV to consecutive positions; rejected nodes' KV is left
        in slots past the new length, where the next step overwrites it."""
        if result.accept_nodes.shape[1] <= 1:
            return  # plain decode: node 0 is already in place
        src, dst = accepted_kv_moves(result.accept_nodes, fwd.seq_lens, fwd.page_table,
                                     page_size=self.page_size)
        self.kv_pool.copy_slots(src, dst)
