"""Weight-only quantized linear layers for the CPU path (``EngineConfig.quantization``).

A decode step of a small model on CPU is bound by the bytes of weights it streams: SmolLM2-135M
in float32 reads ~540 MB per step. These layers keep the weights as int8 (one scale per output
channel) or int4 (asymmetric, one scale and one offset per group of input channels) and
multiply with torch's packed CPU kernels, which dequantize inside the GEMM.

* :class:`Int8Linear`: ``torch.ops.aten._weight_int8pack_mm`` (symmetric per-output-channel
  scales, 4x fewer weight bytes than float32).
* :class:`Int4Linear`: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` over a weight packed by
  ``_convert_weight_to_int4pack_for_cpu`` (8x fewer bytes plus the group scales). With group
  size 32 the groups are the blocks of a GGUF Q4_1 tensor: Q4_1 stores each block of 32
  weights as ``q * d + m`` with ``q`` in 0..15, which is this layer's
  ``(q - 8) * scale + zero`` with ``scale = d`` and ``zero = m + 8 d``; quantizing the
  dequantized float32 weights with the block's min/max recovers ``q`` exactly (``d`` and
  ``m`` to bfloat16, below).

**bfloat16 activations.** On x86 both kernels have an AVX512/AVX2 path for bfloat16
activations only (torch 2.13, ``aten/src/ATen/native/cpu/int{8,4}mm_kernel.cpp``); float32
activations fall to a scalar loop, measured 7-25x slower than the float32 GEMM it replaces.
So the layers round their input rows to bfloat16, the kernels accumulate in float32 and
round the result to bfloat16, and the layer returns it as float32 (the residual stream,
norms, attention and the logits stay float32). The scales (and int4 offsets) are bfloat16
too: that is the dtype the kernels read them in.

Both kernels compute every output row from its own input row only (each ``(row, column)``
dot product runs the same instruction sequence whatever the row count), so a token's result
does not depend on how many rows share the call; tests/layers/test_quant_linear.py checks it
bit for bit (speculation's lossless property needs it).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["INT4_GROUP_SIZES", "KERNEL_DTYPE", "Fp16Linear", "Int4Linear", "Int8Linear", "QuantizedLinear",
           "quantize_int4_groupwise", "quantize_int8_per_channel"]

KERNEL_DTYPE = torch.bfloat16
"""Activation, scale and result dtype of the packed kernels' vectorized x86 paths."""

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes ``_weight_int4pack_mm_for_cpu`` accepts (input channels per scale/offset)."""


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per output channel (row).

    Args:
        weight: ``[N, K]`` float tensor.

    Returns:
        ``(q [N, K] int8, scales [N] float32)`` with ``weight ~= q * scales[:, None]``;
        ``q`` in ``[-127, 127]`` (symmetric: -128 is never used). An all-zero row gets scale 1.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def quantize_int4_groupwise(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 quantization with one (scale, offset) per ``group_size`` input channels.

    Each group maps its ``[min, max]`` onto ``q`` in 0..15; the dequantized weight is
    ``(q - 8) * scale + zero`` (the formula of torch's int4 CPU kernel), i.e.
    ``zero = min + 8 * scale``.

    Args:
        weight: ``[N, K]`` float tensor; ``K`` a multiple of ``group_size``.
        group_size: one of :data:`INT4_GROUP_SIZES`.

    Returns:
        ``(q [N, K] int32 in 0..15, scales [N, K // group_size] float32,
        zeros [N, K // group_size] float32)``.

    Raises:
        ValueError: ``group_size`` is not supported or does not divide ``K``.
    """
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size={group_size}: expected one of {INT4_GROUP_SIZES}")
    if k % group_size:
        raise ValueError(f"int4 group_size={group_size} does not divide the {k} input channels")
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # constant group
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.int32)
    zeros = lo + 8.0 * scales
    return q.view(n, k), scales, zeros


class Int8Linear(nn.Module):
    """``y = x @ (q * scales[:, None]).T + bias`` with int8 weights (weight-only).

    Attributes:
        weight_int8: ``[N, K]`` int8 buffer.
        scales: ``[N]`` bfloat16 buffer (the activation dtype the kernel runs in).
        bias: ``[N]`` float32 buffer or None.
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Quantize a float ``[N, K]`` weight (on CPU) with :func:`quantize_int8_per_channel`."""
        q, scales = quantize_int8_per_channel(weight)
        return cls(q, scales.to(KERNEL_DTYPE),
                   None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` float32 (CPU) -> ``[..., N]`` float32 (computed from bfloat16-rounded
        ``x``, rounded to bfloat16; see the module docstring)."""
        # .to() makes a fresh (aligned, contiguous) bf16 copy: the AVX512 kernel uses aligned
        # loads on the rows of A.
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of weight data a forward streams (int8 weight + scales)."""
        return self.weight_int8.numel() + self.scales.numel() * self.scales.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W = (q - 8) * scale + zero`` per group (weight-only int4).

    Attributes:
        weight_int4: the packed weight from ``_convert_weight_to_int4pack_for_cpu``
            (``[N, K // 2]`` uint8).
        scales_and_zeros: ``[K // group_size, N, 2]`` bfloat16 buffer (scale, zero).
        group_size: input channels per group.
        bias: ``[N]`` float32 buffer or None.
    """

    def __init__(self, weight_int4: torch.Tensor, scales_and_zeros: torch.Tensor,
                 group_size: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = scales_and_zeros.shape[1]
        self.group_size = group_size
        self.register_buffer("weight_int4", weight_int4)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   group_size: int) -> Int4Linear:
        """Quantize a float ``[N, K]`` weight (on CPU) with :func:`quantize_int4_groupwise`.

        Raises:
            ValueError: as :func:`quantize_int4_groupwise`.
        """
        q, scales, zeros = quantize_int4_groupwise(weight, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        return cls(packed, sz, group_size, weight.shape[1],
                   None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` float32 (CPU) -> ``[..., N]`` float32 (computed from bfloat16-rounded
        ``x``, rounded to bfloat16; see the module docstring)."""
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.weight_int4, self.group_size, self.scales_and_zeros).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of weight data a forward streams (packed int4 + group scales and zeros)."""
        return (self.weight_int4.numel() * self.weight_int4.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"group_size={self.group_size}")


class Fp16Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` stored as float16, float32 activations and result.

    FBGEMM's packed fp16 GEMM (``torch.ops.quantized.linear_dynamic_fp16``; "dynamic" in the
    name only: nothing of the activations is quantized) widens the weights to float32 inside
    its AVX2/AVX512 micro-kernel and accumulates in float32. Half the bytes of float32 with a
    10-bit mantissa: used for the LM head, whose argmax int8/int4 move most (measured,
    :mod:`structspec.models.quantize`). Each output row depends on its own input row only.

    Attributes:
        packed: FBGEMM's packed weight (an opaque ``torch.ScriptObject``).
        bias: ``[N]`` float32 buffer or None (added after the GEMM).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp16Linear:
        """Pack a float ``[N, K]`` weight (on CPU) as float16."""
        return cls(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` float32 (CPU) -> ``[..., N]`` float32."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of weight data a forward streams (float16 weight)."""
        return 2 * self.out_features * self.in_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16"


QuantizedLinear = Int8Linear | Int4Linear | Fp16Linear
"""Either weight-only layer (``isinstance`` checks take the union)."""
