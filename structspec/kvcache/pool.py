"""The KV pool: per-layer K and V tensors indexed by token slot, handed out in pages."""

from __future__ import annotations

import torch


class KVPool:
    """K/V storage for every layer, ``num_pages * page_size`` token slots each.

    Tensors: ``k_cache[layer]`` and ``v_cache[layer]`` are ``[num_slots, num_kv_heads,
    head_dim]`` of the model dtype on the model device. Slot ``s`` belongs to page
    ``s // page_size``. Page 0 is reserved: its slots absorb the writes of padding rows, so it is
    never allocated to a request (see :class:`structspec.kvcache.allocator.PageAllocator`).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {num_pages}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def size_bytes(self) -> int:
        per = self.k_cache[0].numel() * self.k_cache[0].element_size()
        return 2 * per * self.num_layers

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K/V of ``src_slots`` to ``dst_slots`` in every layer (``[n]`` int64, device).

        Used to compact the accepted path of a draft tree into consecutive positions. Source and
        destination may overlap only where ``src == dst`` (gather first, then scatter).
        """
        if src_slots.numel() == 0:
            return
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst_slots] = k[src_slots]
            v[dst_slots] = v[src_slots]
