"""Fused rotary + K/V store vs ``apply_rotary`` + ``write_kv``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from structspec.kernels.rotary import rotary_and_store_kv  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.attention import write_kv  # noqa: E402
from structspec.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.kernels.conftest import dtypes, tol  # noqa: E402


def _pool(hkv: int, d: int, dtype: torch.dtype, dev: torch.device) -> KVPool:
    return KVPool(num_layers=2, num_pages=8, page_size=16, num_kv_heads=hkv, head_dim=d,
                  dtype=dtype, device=dev)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("b,s,hq,hkv,d", [(1, 1, 9, 3, 64), (2, 5, 4, 2, 32), (3, 7, 8, 8, 128),
                                          (1, 4, 6, 2, 48)])
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}])
@torch.no_grad()
def test_matches_reference(
    dev: torch.device, dtype: torch.dtype, b: int, s: int, hq: int, hkv: int, d: int,
    rope_scaling: dict | None,
) -> None:
    torch.manual_seed(0)
    rot = RotaryEmbedding(head_dim=d, rope_theta=10000.0, max_position_embeddings=256,
                          rope_scaling=rope_scaling).to(dev)
    rot.reset_inv_freq()
    qkv = torch.randn(b, s, (hq + 2 * hkv) * d).to(dev, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as in the model
    q = q.view(b, s, hq, d)
    k = k.view(b, s, hkv, d)
    v = v.view(b, s, hkv, d)
    positions = torch.randint(0, 200, (b, s)).to(dev)
    cos, sin = rot(positions, dtype)
    slots = (16 + torch.randperm(100)[: b * s]).view(b, s).to(dev)
    slots[-1, -1] = 0  # a padding token writing the sink
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ref_pool, pool = _pool(hkv, d, dtype, dev), _pool(hkv, d, dtype, dev)
    write_kv(ref_pool, 1, slots, ref_k, v)
    q_in = q.clone()
    out = rotary_and_store_kv(q, k, v, cos, sin, pool.k_cache[1], pool.v_cache[1], slots)
    assert out is q
    torch.testing.assert_close(q, ref_q, **tol(dtype))
    torch.testing.assert_close(pool.k_cache[1], ref_pool.k_cache[1], **tol(dtype))
    assert torch.equal(pool.v_cache[1], ref_pool.v_cache[1])
    assert not pool.k_cache[0].any()  # other layers untouched
    # q_out variant leaves q alone
    q_out = torch.empty_like(q_in)
    rotary_and_store_kv(q_in, k, v, cos, sin, pool.k_cache[0], pool.v_cache[0], slots,
                        q_out=q_out)
    torch.testing.assert_close(q_out, ref_q, **tol(dtype))
    assert torch.equal(pool.k_cache[0], pool.k_cache[1])


def test_rejects_mismatched_tokens(dev: torch.device) -> None:
    q = torch.zeros(3, 2, 16, device=dev)
    k = torch.zeros(3, 1, 16, device=dev)
    cos = torch.zeros(2, 16, device=dev)
    cache = torch.zeros(8, 1, 16, device=dev)
    slots = torch.zeros(3, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="same tokens"):
        rotary_and_store_kv(q, k, k, cos, cos, cache, cache, slots)
