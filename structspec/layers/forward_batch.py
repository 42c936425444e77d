"""The per-forward attention metadata every model and attention backend reads.

One layout serves prefill (many query tokens per request), decode (one) and draft-tree verify
(N tree nodes per request with an ancestor mask): a padded ``[B, Q]`` block of query tokens per
request, explicit rotary positions, the KV slot each query token writes, the KV slots each
request reads, and a boolean mask between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Inputs of one target (or draft) forward. All tensors live on the model's device.

    Attributes:
        input_ids: ``[B, Q]`` int64 token ids; padding rows hold 0.
        positions: ``[B, Q]`` int64 rotary positions (tree nodes: prefix length + depth).
        out_slots: ``[B, Q]`` int64 KV-pool slot each query token writes its K/V to; padding
            rows write slot 0, the pool's reserved sink.
        kv_slots: ``[B, L]`` int64 KV-pool slots each request attends over, in position order,
            *including* the slots written by this forward (``out_slots``); padding holds 0.
        attn_mask: ``[B, Q, L]`` bool, True where query ``q`` may attend to ``kv_slots[b, l]``.
            Every row has at least one True entry (padding rows attend to column 0), so softmax
            never sees an all ``-inf`` row.
        logits_indices: ``[R]`` int64 indices into the flattened ``[B * Q]`` rows whose logits
            are needed (last prompt token in prefill, every node in verify); None = all rows.
        causal_start: ``[B]`` int64, set only when the forward is a causal chain (a prompt or
            a prompt chunk): query row ``q`` of request ``b`` sits at position
            ``causal_start[b] + q`` and ``attn_mask[b, q]`` is True exactly on columns
            ``0 .. causal_start[b] + q`` for every real row. A backend may then apply that
            rule instead of reading the mask (the Triton backend does: no ``[Q, L]`` mask
            traffic, no masking of the cached prefix); padding rows' outputs are discarded
            and may differ between the two. None = use ``attn_mask``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: torch.Tensor
    attn_mask: torch.Tensor
    logits_indices: torch.Tensor | None = None
    causal_start: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_query_tokens(self) -> int:
        return int(self.input_ids.shape[1])
