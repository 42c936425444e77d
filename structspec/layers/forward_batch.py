"""The per-forward attention metadata every model and attention backend reads.

One layout serves prefill (many query tokens per request), decode (one) and draft-tree verify
(N tree nodes per request with an ancestor mask): a padded ``[B, Q]`` block of query tokens per
request, explicit rotary positions, the KV slot each query token writes, the KV slots each
request reads, and a boolean mask between them (for a causal chain, a prompt or a prompt
chunk, the mask is a rule given by ``causal_start`` and built only when a backend asks).
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
            never sees an all ``-inf`` row. None when ``causal_start`` gives the rule instead
            (backends read :meth:`mask`).
        logits_indices: ``[R]`` int64 indices into the flattened ``[B * Q]`` rows whose logits
            are needed (last prompt token in prefill, every node in verify); None = all rows.
        causal_start: ``[B]`` int64, set only when the forward is a causal chain (a prompt or
            a prompt chunk): query row ``q`` of request ``b`` sits at position
            ``causal_start[b] + q`` and sees exactly columns ``0 .. causal_start[b] + q`` (on
            every real row; padding rows' outputs are discarded). The Triton backend applies
            that rule in its causal kernel and never builds the ``[B, Q, L]`` mask; the torch
            reference builds it from the rule (:meth:`mask`). None = ``attn_mask`` is given.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: torch.Tensor
    attn_mask: torch.Tensor | None
    logits_indices: torch.Tensor | None = None
    causal_start: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """``[B, Q, L]`` bool attention mask: ``attn_mask``, or, for a causal chain, the rule
        ``column <= causal_start[b] + q`` built once on the batch's device and kept (the
        reference backend asks once per layer).

        Raises:
            ValueError: neither ``attn_mask`` nor ``causal_start`` is set.
        """
        if self.attn_mask is None:
            if self.causal_start is None:
                raise ValueError("ForwardBatch: neither attn_mask nor causal_start is set")
            device = self.kv_slots.device
            last = (self.causal_start.view(-1, 1, 1)
                    + torch.arange(self.input_ids.shape[1], device=device).view(1, -1, 1))
            self.attn_mask = (torch.arange(self.kv_slots.shape[1], device=device)
                              .view(1, 1, -1) <= last)
        return self.attn_mask

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_query_tokens(self) -> int:
        return int(self.input_ids.shape[1])
