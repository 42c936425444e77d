"""The KV pool: per-layer K and V tensors indexed by token slot, handed out in pages."""

from __future__ import annotations

import math

import numpy as np
import torch


class KVPool:
    """K/V storage for every layer, ``num_pages * page_size`` token slots each.

    Tensors: ``k_cache[layer]`` and ``v_cache[layer]`` are ``[num_slots, num_kv_heads,
    head_dim]`` of the model dtype on the model device, views of one ``kv_buffer``
    ``[2, num_layers, num_slots, num_kv_heads, head_dim]``. Slot ``s`` belongs to page
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
        # One allocation for every layer's K and V, so that moving slots (the accepted-path
        # compaction after each verify) is one gather + one scatter over all layers instead
        # of 4 small ops per layer (~1.4 ms of host launch time per step for 30 layers).
        self.kv_buffer = zeros_on_touch((2, num_layers, self.num_slots, num_kv_heads, head_dim),
                                        dtype=dtype, device=torch.device(device))
        self.k_cache = list(self.kv_buffer[0].unbind(0))
        self.v_cache = list(self.kv_buffer[1].unbind(0))

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
        moved = self.kv_buffer.index_select(2, src_slots)  # gather before any write
        self.kv_buffer.index_copy_(2, dst_slots, moved)


_ALIGN_BYTES = 64


def zeros_on_touch(shape: tuple[int, ...], *, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory is only committed, page by page, when first touched.

    ``torch.zeros`` on CPU writes every byte up front: for the default CPU KV cache (32,768
    tokens of SmolLM2-135M in fp32, 1.5 GB) that was ~3 s of page faults and memset at every
    engine start, and 1.5 GB resident however few tokens were served. ``numpy.zeros``
    allocates with ``calloc``, whose large blocks are fresh anonymous pages the kernel zeroes
    on first access, so the same zeros cost nothing until a slot is written and only the
    written pages become resident (how llama.cpp's untouched KV buffers behave too). On other
    devices: ``torch.zeros``.

    Args:
        shape: the tensor's shape.
        dtype: any torch dtype (the memory is allocated as bytes and viewed as ``dtype``).
        device: where it lives.

    Returns:
        A contiguous zero tensor of ``shape`` and ``dtype`` on ``device``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + _ALIGN_BYTES, dtype=np.uint8))
    start = -raw.data_ptr() % _ALIGN_BYTES  # calloc aligns to 16 bytes; SIMD rows like 64
    return raw[start:start + nbytes].view(dtype).view(shape)
