"""KVPool.copy_slots: one gather + scatter over all layers equals per-layer copies."""

from __future__ import annotations

import torch

from structspec.kvcache.pool import KVPool


def test_copy_slots_moves_every_layer_and_leaves_the_rest() -> None:
    pool = KVPool(num_layers=3, num_pages=4, page_size=4, num_kv_heads=2, head_dim=5,
                  dtype=torch.float32, device=torch.device("cpu"))
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k_cache, pool.v_cache, strict=True)]
    src = torch.tensor([5, 6, 9])
    dst = torch.tensor([5, 7, 8])  # overlaps only where src == dst
    pool.copy_slots(src, dst)
    for (k0, v0), k, v in zip(before, pool.k_cache, pool.v_cache, strict=True):
        ref_k, ref_v = k0.clone(), v0.clone()
        ref_k[dst], ref_v[dst] = k0[src], v0[src]
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
        assert k.data_ptr() != v.data_ptr()
    assert pool.k_cache[1].data_ptr() == pool.kv_buffer[0, 1].data_ptr()  # views, not copies
