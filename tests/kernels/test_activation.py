"""Triton ``silu_and_mul`` vs ``F.silu(gate) * up``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from structspec.kernels.activation import silu_and_mul  # noqa: E402
from tests.kernels.conftest import dtypes, tol  # noqa: E402


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (3, 5, 2 * 100), (7, 2 * 1030)])
@torch.no_grad()
def test_silu_and_mul(dev: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    gu = (4 * torch.randn(shape)).to(dev, dtype)
    gate, up = gu.split(shape[-1] // 2, dim=-1)
    out = silu_and_mul(gu)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up, **tol(dtype))


@torch.no_grad()
def test_silu_and_mul_empty(dev: torch.device) -> None:
    assert silu_and_mul(torch.empty(0, 8, device=dev)).shape == (0, 4)
