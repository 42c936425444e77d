"""Triton RMSNorm / fused add + RMSNorm vs :class:`structspec.layers.norm.RMSNorm`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from structspec.kernels.norm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from structspec.layers.norm import RMSNorm  # noqa: E402
from tests.kernels.conftest import dtypes, tol  # noqa: E402


def _norm(n: int, dtype: torch.dtype, dev: torch.device) -> RMSNorm:
    m = RMSNorm(n, eps=1e-5)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.2 * torch.randn(n, generator=torch.Generator().manual_seed(n)))
    return m.to(dev, dtype)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (7, 100), (2, 4, 3, 32)])
@torch.no_grad()
def test_rmsnorm(dev: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = (3 * torch.randn(shape)).to(dev, dtype)
    m = _norm(shape[-1], dtype, dev)
    out = rmsnorm(x, m.weight, m.eps)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, m(x), **tol(dtype))


@pytest.mark.parametrize("dtype", dtypes())
@torch.no_grad()
def test_rmsnorm_strided_heads(dev: torch.device, dtype: torch.dtype) -> None:
    """Per-head norm of a strided q view into a fused qkv output (Qwen3's q_norm)."""
    torch.manual_seed(1)
    qkv = torch.randn(2, 3, 4 * 32 + 2 * 2 * 32).to(dev, dtype)
    q = qkv[..., : 4 * 32].view(2, 3, 4, 32)
    m = _norm(32, dtype, dev)
    torch.testing.assert_close(rmsnorm(q, m.weight, m.eps), m(q), **tol(dtype))


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 9, 64), (5, 100)])
@torch.no_grad()
def test_fused_add_rmsnorm(dev: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape).to(dev, dtype)
    residual = (2 * torch.randn(shape)).to(dev, dtype)
    m = _norm(shape[-1], dtype, dev)
    ref_h = residual + x  # what the torch path keeps as the residual stream
    ref = m(ref_h)
    res = residual.clone()
    out = fused_add_rmsnorm(x, res, m.weight, m.eps)
    assert torch.equal(res, ref_h)  # the add rounds exactly like torch's
    torch.testing.assert_close(out, ref, **tol(dtype))


def test_fused_add_rmsnorm_needs_contiguous_residual(dev: torch.device) -> None:
    x = torch.randn(4, 8, device=dev)
    with pytest.raises(ValueError, match="contiguous"):
        fused_add_rmsnorm(x, torch.randn(8, 4, device=dev).t(), torch.ones(8, device=dev), 1e-6)
