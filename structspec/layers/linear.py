"""Linear layers whose float32 result is not rounded to the 16-bit input dtype first.

Triton-free (imported by the torch reference path on CPU as well as by
:mod:`structspec.kernels.gemv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_fp32_out"]


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32 without rounding to ``x``'s dtype first.

    On CUDA with float16/bfloat16 inputs this is one cuBLAS GEMM that writes its float32
    accumulator (``torch.mm(..., out_dtype=torch.float32)``, PyTorch >= 2.8) - the
    ``--enable-fp32-lm-head`` idea of sglang: logits keep the precision the GEMM computed
    them in, instead of bf16's 8 bits of mantissa (a step of 0.125 at magnitude 16-32, so
    the top two logits are often exactly equal). Elsewhere (CPU, float32 inputs) it is
    ``F.linear(x, weight).float()``.

    Args:
        x: ``[..., K]``; weight: ``[N, K]``, same dtype and device.

    Returns:
        ``[..., N]`` float32 on ``x``'s device.
    """
    if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16):
        k = x.shape[-1]
        y = torch.mm(x.reshape(-1, k), weight.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight).float()
