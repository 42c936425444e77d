"""RMSNorm and fused residual-add + RMSNorm (one Triton program per row).

Numerics follow Hugging Face's ``LlamaRMSNorm`` (and :class:`structspec.layers.norm.RMSNorm`):
the variance is computed in float32, the normalised row is cast to the input dtype *before*
the weight multiply, and the product is rounded once to the output dtype. The fused variant
first rounds ``residual + x`` to the residual's dtype (what ``h = h + attn(h)`` does in torch)
and normalises that rounded value. Only the reduction order of the variance differs from
torch, so fp32 results agree to a few ulps, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structspec.kernels import next_pow2


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        # Round the sum to the residual dtype first: that is the value torch keeps in ``h``.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(x.dtype)  # cast before the weight multiply, as HF does
    w = tl.load(W + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=ok)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, n]`` with unit column stride (a view when possible, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x)`` over the last dimension.

    Args:
        x: ``[..., N]`` float tensor (any strides; rows are the flattened leading dims).
        weight: ``[N]`` on ``x``'s device.
        eps: added to the variance.

    Returns:
        A new contiguous tensor of ``x``'s shape, dtype ``promote(weight, x)`` (as torch's
        ``weight * h.to(x.dtype)`` gives), same device.
    """
    x2 = _rows(x)
    return _launch(x2, x2, weight, eps, has_residual=False).view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then return ``weight * norm(residual)``.

    Args:
        x: ``[..., N]`` (e.g. the attention or MLP output), same shape as ``residual``.
        residual: ``[..., N]`` contiguous residual stream; updated in place with the sum
            rounded to its dtype.
        weight: ``[N]``.
        eps: added to the variance.

    Returns:
        A new tensor of ``residual``'s shape, dtype ``promote(weight, residual)``.

    Raises:
        ValueError: ``residual`` is not contiguous or the shapes differ.
    """
    if not residual.is_contiguous() or x.shape != residual.shape:
        raise ValueError(f"residual must be contiguous and shaped like x: x {tuple(x.shape)}, "
                         f"residual {tuple(residual.shape)}")
    n = x.shape[-1]
    return _launch(_rows(x), residual.view(-1, n), weight, eps, has_residual=True).view(
        residual.shape)


def _launch(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, *,
            has_residual: bool) -> torch.Tensor:
    """One program per row of ``x2`` / ``r2`` (``[rows, N]``); returns ``[rows, N]`` of dtype
    ``promote(weight, r2)``. Without a residual pass ``r2 = x2`` (it is not written)."""
    n = x2.shape[-1]
    out = torch.empty(r2.shape, dtype=torch.promote_types(weight.dtype, r2.dtype),
                      device=x2.device)
    if r2.shape[0] == 0:
        return out
    block = next_pow2(n)
    _rmsnorm_kernel[(r2.shape[0],)](
        x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
        BLOCK=block, HAS_RESIDUAL=has_residual, num_warps=_num_warps(block),
    )
    return out
