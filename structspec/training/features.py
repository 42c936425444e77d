"""Target features for EAGLE-3 training, captured inside structspec's own target forward.

A training batch is ``[B, T]`` right-padded token rows. The target model (the engine's
:class:`~structspec.models.llama.LlamaForCausalLM`, no transformers model) runs one prefill
forward over it without gradients and returns, per position, the concatenated outputs of the
three EAGLE-3 decoder layers (``[B, T, 3H]``, the head's ``fc`` input, exactly what the
serving forward hands :meth:`structspec.speculative.eagle.EagleDrafter.on_target_hidden`) and
the target's float32 logits (``[B, T, V]``, the soft targets).

Cheapest correct path: the model's forward always writes K/V into a pool, so a scratch
:class:`~structspec.kvcache.pool.KVPool` with one slot per batch position is kept and every row
owns a contiguous run of slots. :class:`ContiguousCausalBackend` then attends over a *view* of
those slots (no gather) with ``is_causal=True`` (flash attention on CUDA, no mask tensor); the
padding at the end of a row is never attended to by its real positions. Features are computed
online, per batch, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from structspec.config import ModelConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch

#: KV page size of the scratch pool (page 0 is the pool's sink; rows start at page 1).
SCRATCH_PAGE = 16


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high feature layers for a target of ``num_layers`` layers:
    ``(1, L//2 - 1, L - 4)`` clamped to ``[0, L)``, the default of
    :func:`structspec.models.eagle_head.parse_eagle_config` (and of SpecForge / sglang)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


class ContiguousCausalBackend:
    """Causal attention for the feature forward: row ``b``'s keys are the ``Q`` contiguous
    slots starting at ``base + b * Q`` that this same forward just wrote.

    Args:
        base: first slot of row 0 (after the pool's sink page).
    """

    def __init__(self, base: int) -> None:
        self.base = base

    def forward(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch,
                kv_pool: KVPool) -> torch.Tensor:
        """``q [B, Q, Hq, D]`` -> ``[B, Q, Hq, D]`` (causal over the row's own positions)."""
        b, s, hq, d = q.shape
        n = b * s
        k = kv_pool.k_cache[layer_id][self.base: self.base + n]
        v = kv_pool.v_cache[layer_id][self.base: self.base + n]
        hkv = k.shape[1]
        k = k.view(b, s, hkv, d)
        v = v.view(b, s, hkv, d)
        if hkv != hq:  # query head h reads KV head h // g (HF repeat_kv order)
            k = k.repeat_interleave(hq // hkv, dim=2)
            v = v.repeat_interleave(hq // hkv, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, scale=d**-0.5)
        return out.transpose(1, 2)

    __call__ = forward


@dataclass
class TargetFeatures:
    """One batch's target outputs (on the model's device).

    Attributes:
        aux_hidden: ``[B, T, len(aux_layers) * H]`` concatenated aux layer outputs, model dtype.
        logits: ``[B, T, V]`` float32 target logits (row t: the distribution of token t+1).
    """

    aux_hidden: torch.Tensor
    logits: torch.Tensor


class TargetFeatureExtractor:
    """Runs the target's prefill forward over training rows and returns its features.

    Args:
        model: the target (a :mod:`structspec.models` causal LM, eval, no grads) on ``device``.
        model_config: its config.
        aux_layers: the EAGLE-3 feature layers (decoder layer indices).
        max_batch_tokens: largest ``B * T`` a call may pass (sizes the scratch KV pool:
            ``2 * layers * kv_heads * head_dim`` elements per token).
        device, dtype: the model's device and dtype (the pool's).

    Raises:
        ValueError: an aux layer outside ``[0, num_hidden_layers)``.
    """

    def __init__(self, model: nn.Module, model_config: ModelConfig, aux_layers: tuple[int, ...],
                 *, max_batch_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        nl = model_config.num_hidden_layers
        bad = [i for i in aux_layers if not 0 <= i < nl]
        if bad:
            raise ValueError(f"aux_hidden_layers {bad} out of range for {nl} layers")
        self.model = model
        self.aux_layers = tuple(aux_layers)
        self.max_batch_tokens = max_batch_tokens
        self.device = device
        pages = 1 + -(-max_batch_tokens // SCRATCH_PAGE)
        self.pool = KVPool(num_layers=nl, num_pages=pages, page_size=SCRATCH_PAGE,
                           num_kv_heads=model_config.num_key_value_heads,
                           head_dim=model_config.head_dim, dtype=dtype, device=device)
        self.backend = ContiguousCausalBackend(SCRATCH_PAGE)

    def forward_batch(self, input_ids: torch.Tensor) -> ForwardBatch:
        """The prefill :class:`ForwardBatch` of ``input_ids [B, T]`` (device): positions
        ``0..T-1``, row b at slots ``base + b*T ..``, a broadcast causal mask (so the reference
        :class:`~structspec.layers.attention.TorchAttentionBackend` reads it the same way)."""
        b, t = input_ids.shape
        slots = self.backend.base + torch.arange(b * t, device=input_ids.device).view(b, t)
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
        return ForwardBatch(input_ids=input_ids, positions=positions, out_slots=slots,
                            kv_slots=slots, attn_mask=mask)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> TargetFeatures:
        """Features of ``input_ids [B, T]`` int64 on the model's device.

        Raises:
            ValueError: ``B * T`` exceeds ``max_batch_tokens``.
        """
        b, t = input_ids.shape
        if b * t > self.max_batch_tokens:
            raise ValueError(f"batch of {b} x {t} tokens exceeds the feature pool's "
                             f"{self.max_batch_tokens} tokens")
        fb = self.forward_batch(input_ids)
        saved = self.model.attn_backend
        self.model.attn_backend = self.backend
        try:
            out = self.model(fb, self.pool, aux_hidden_layers=self.aux_layers)
        finally:
            self.model.attn_backend = saved
        hidden = out.hidden_states
        logits = self.model.compute_logits(hidden.reshape(b * t, -1)).view(b, t, -1)
        return TargetFeatures(aux_hidden=torch.cat(list(out.aux_hidden_states), dim=-1),
                              logits=logits)
