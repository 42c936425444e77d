"""Rotary embedding on q and k fused with the K/V store into the paged pool.

One program per token: rotates all query heads in place, rotates the key heads and writes
them, and the value heads unchanged, into ``k_cache`` / ``v_cache`` at the token's slot. This
replaces ~10 elementwise torch ops for rotary plus two ``index_copy_`` per layer.

Layout is NeoX/HF half-split: ``out[:D/2] = x1*cos1 - x2*sin1``, ``out[D/2:] = x2*cos2 +
x1*sin2`` with ``cos``/``sin`` as produced by
:class:`structspec.layers.rotary.RotaryEmbedding` (``[..., D]``, model dtype). Each product and
the sum are rounded to the input dtype, as torch's ``x * cos + rotate_half(x) * sin`` rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structspec.kernels import next_pow2


@triton.jit
def _rotate_tile(x1, x2, c1, c2, s1, s2):
    """Rotate one ``[heads, D/2]`` pair of halves; products and sum rounded to x's dtype."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rotary_store_kernel(
    Q, K, V, Cos, Sin, KC, VC, Slots, QOut,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st, stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_ot, stride_oh,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c1 = tl.load(Cos + t * stride_ct + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_ct + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_st + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_st + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)
    qm = (hq < HQ)[:, None] & jm[None, :]
    q_ptr = Q + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    o_ptr = QOut + t * stride_ot + hq[:, None] * stride_oh + j[None, :]
    q1, q2 = _rotate_tile(tl.load(q_ptr, mask=qm, other=0.0),
                          tl.load(q_ptr + HALF, mask=qm, other=0.0), c1, c2, s1, s2)
    tl.store(o_ptr, q1, mask=qm)
    tl.store(o_ptr + HALF, q2, mask=qm)

    slot = tl.load(Slots + t)
    hk = tl.arange(0, BLOCK_HKV)
    km = (hk < HKV)[:, None] & jm[None, :]
    k_ptr = K + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
    k1, k2 = _rotate_tile(tl.load(k_ptr, mask=km, other=0.0),
                          tl.load(k_ptr + HALF, mask=km, other=0.0), c1, c2, s1, s2)
    kc_ptr = KC + slot * stride_kcs + hk[:, None] * stride_kch + j[None, :]
    tl.store(kc_ptr, k1.to(KC.dtype.element_ty), mask=km)
    tl.store(kc_ptr + HALF, k2.to(KC.dtype.element_ty), mask=km)
    v_ptr = V + t * stride_vt + hk[:, None] * stride_vh + j[None, :]
    vc_ptr = VC + slot * stride_vcs + hk[:, None] * stride_vch + j[None, :]
    tl.store(vc_ptr, tl.load(v_ptr, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)
    tl.store(vc_ptr + HALF,
             tl.load(v_ptr + HALF, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)


def _tokens(x: torch.Tensor, name: str) -> torch.Tensor:
    """``[..., H, D]`` as a ``[T, H, D]`` *view* with unit stride on D."""
    try:
        x3 = x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name} {tuple(x.shape)} must flatten to [T, H, D] without a copy") from e
    if x3.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride on head_dim")
    return x3


def rotary_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``; store rotated ``k`` and ``v`` at ``out_slots`` in the pool.

    Args:
        q: ``[..., Hq, D]`` queries (e.g. a strided view of the fused qkv output); rotated in
            place unless ``q_out`` is given. Leading dims flatten to ``T`` tokens.
        k, v: ``[..., Hkv, D]`` keys/values of the same ``T`` tokens (read only).
        cos, sin: ``[..., D]`` per token (``RotaryEmbedding`` output), any float dtype.
        k_cache, v_cache: this layer's pool tensors ``[num_slots, Hkv, D]``.
        out_slots: ``[...]`` int64 slot per token (padding tokens hold the sink slot 0;
            concurrent writes there are harmless, the sink is never read by real rows).
        q_out: optional ``[..., Hq, D]`` output buffer for the rotated queries.

    All tensors on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``D`` even.

    Returns:
        The rotated queries (``q_out`` if given, else ``q`` itself).
    """
    q3, k3, v3 = _tokens(q, "q"), _tokens(k, "k"), _tokens(v, "v")
    o3 = q3 if q_out is None else _tokens(q_out, "q_out")
    t, hq, d = q3.shape
    hkv = k3.shape[1]
    cos2, sin2 = cos.reshape(-1, d), sin.reshape(-1, d)
    slots = out_slots.reshape(-1)
    if not (k3.shape[0] == v3.shape[0] == cos2.shape[0] == sin2.shape[0] == slots.shape[0] == t):
        raise ValueError("q, k, v, cos, sin and out_slots must cover the same tokens")
    if cos2.stride(-1) != 1 or sin2.stride(-1) != 1 or not slots.is_contiguous():
        cos2, sin2, slots = cos2.contiguous(), sin2.contiguous(), slots.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must have unit stride on head_dim")
    if t == 0:
        return q if q_out is None else q_out
    half = d // 2
    _rotary_store_kernel[(t,)](
        q3, k3, v3, cos2, sin2, k_cache, v_cache, slots, o3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        cos2.stride(0), sin2.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), o3.stride(0), o3.stride(1),
        HQ=hq, HKV=hkv, HALF=half, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv),
        BLOCK_HALF=next_pow2(half), num_warps=1 if hq * d <= 1024 else 4,
    )
    return q if q_out is None else q_out
