"""Reference attention backend (torch SDPA over gathered KV slots) and the KV write helper.

Both are free of host syncs and data-dependent shapes, so they run on CPU and GPU and can be
captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """What models call to attend: :class:`TorchAttentionBackend` (reference, CPU and CUDA) or
    :class:`structspec.kernels.attention.TritonAttentionBackend` (CUDA)."""

    def forward(
        self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, kv_pool: KVPool
    ) -> torch.Tensor:
        """``q [B, Q, Hq, D]`` -> ``[B, Q, Hq, D]`` over ``fb.kv_slots`` under ``fb.mask()``."""
        ...


def write_kv(
    kv_pool: KVPool, layer_id: int, out_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store this forward's keys/values into the pool.

    Args:
        kv_pool: target pool; ``k_cache[layer_id]`` is ``[num_slots, Hkv, D]``.
        layer_id: decoder layer index.
        out_slots: ``[B, Q]`` int64 slots (padding rows hold 0, the sink slot).
        k, v: ``[B, Q, Hkv, D]`` in the pool's dtype, on its device.
    """
    idx = out_slots.reshape(-1)
    kv_pool.k_cache[layer_id].index_copy_(0, idx, k.reshape(idx.shape[0], *k.shape[2:]))
    kv_pool.v_cache[layer_id].index_copy_(0, idx, v.reshape(idx.shape[0], *v.shape[2:]))


class TorchAttentionBackend:
    """Masked attention of a ``[B, Q]`` query block over the KV slots ``fb.kv_slots``.

    Gathers K/V ``[B, L, Hkv, D]`` with ``index_select`` and runs
    ``torch.nn.functional.scaled_dot_product_attention`` with the boolean mask
    ``fb.attn_mask[:, None]`` (``[B, 1, Q, L]``), GQA via ``enable_gqa``, scale ``1/sqrt(D)``.
    The K/V of this forward must already be written (see :func:`write_kv`).

    Args:
        fold_gqa: on CUDA only, fold the GQA group into the query axis (``[B, Hkv, Q*G, D]``
            queries against ``Hkv`` KV heads) so SDPA runs plain multi-head attention, which
            lets it pick a fused kernel with a mask; same math, different rounding. CPU
            forwards never take this path.
    """

    def __init__(self, fold_gqa: bool = False) -> None:
        self.fold_gqa = fold_gqa

    def forward(
        self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, kv_pool: KVPool
    ) -> torch.Tensor:
        """Attend.

        Args:
            q: ``[B, Q, Hq, D]`` queries (after rotary), model dtype/device.
            layer_id: decoder layer index into ``kv_pool``.
            fb: batch metadata; uses ``kv_slots [B, L]`` and the mask ``[B, Q, L]`` (``fb.mask()``).
            kv_pool: KV storage.

        Returns:
            ``[B, Q, Hq, D]`` attention output, same dtype/device as ``q``.
        """
        b, s, hq, d = q.shape
        k_all, v_all = kv_pool.k_cache[layer_id], kv_pool.v_cache[layer_id]
        hkv = k_all.shape[1]
        idx = fb.kv_slots.reshape(-1)
        num_kv = fb.kv_slots.shape[1]
        k = k_all.index_select(0, idx).view(b, num_kv, hkv, d).transpose(1, 2)
        v = v_all.index_select(0, idx).view(b, num_kv, hkv, d).transpose(1, 2)
        if self.fold_gqa and q.is_cuda and hkv != hq:
            g = hq // hkv  # query head h reads KV head h // g (HF repeat_kv order)
            qf = q.view(b, s, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, s * g, d)
            mask = fb.mask()[:, None, :, None, :].expand(b, 1, s, g, num_kv)
            out = F.scaled_dot_product_attention(
                qf, k, v, attn_mask=mask.reshape(b, 1, s * g, num_kv), scale=d**-0.5
            )
            return out.view(b, hkv, s, g, d).permute(0, 2, 1, 3, 4).reshape(b, s, hq, d)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=fb.mask()[:, None], scale=d**-0.5,
            enable_gqa=hkv != hq,
        )
        return out.transpose(1, 2)

    __call__ = forward
