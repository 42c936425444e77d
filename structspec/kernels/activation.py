"""SwiGLU activation: ``silu(gate) * up`` over a fused ``[gate | up]`` projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(GU, Out, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # torch computes F.silu in float32 and rounds to the input dtype, then rounds the product:
    # round the same two times so bf16 results match the reference path.
    act = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``.

    Args:
        gate_up: ``[..., 2I]`` float tensor (rows = flattened leading dims), CUDA (or CPU under
            ``TRITON_INTERPRET=1``).

    Returns:
        A new contiguous ``[..., I]`` tensor of ``gate_up``'s dtype and device.
    """
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    out = torch.empty((gu.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] > 0:
        grid = (gu.shape[0], triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=_BLOCK,
                                   num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)
