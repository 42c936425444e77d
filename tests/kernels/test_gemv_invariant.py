"""``invariant_linear``: each row's bits do not depend on how many rows share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from structspec.kernels import gemv  # noqa: E402
from structspec.kernels.gemv import MAX_ROWS, invariant_config, invariant_linear  # noqa: E402
from tests.kernels.conftest import dtypes  # noqa: E402

# (N, K): K=64 is one BLOCK_K tile; K=264 is split over several programs (split-K reduce)
# and is not a multiple of BLOCK_K (masked tail), in float32 under the interpreter.
SHAPES = [(48, 64), (48, 264)]


def _data(m: int, n: int, k: int, dtype: torch.dtype, dev: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 * m + n + k)
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype)
    return x, w, b


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def test_config_does_not_depend_on_rows() -> None:
    """The configuration is the 16-row table entry on the dot path, split-K included."""
    dev = torch.device("cpu")
    cfg = invariant_config(48, 264, dev, torch.float32)
    assert cfg.use_dot is True
    assert cfg == gemv._config(MAX_ROWS, 48, 264, 16, 4)._replace(use_dot=True)
    assert cfg.split_k > 1  # so the tests below exercise the split-K reduce


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("nk", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@torch.no_grad()
def test_rows_are_bitwise_independent_of_m(dev: torch.device, dtype: torch.dtype,
                                           nk: tuple[int, int], with_bias: bool,
                                           out_dtype: torch.dtype | None) -> None:
    n, k = nk
    x, w, b = _data(40, n, k, dtype, dev)
    bias = b if with_bias else None
    singles = torch.cat([invariant_linear(x[r:r + 1], w, bias, out_dtype) for r in range(40)])
    want = out_dtype or dtype
    assert singles.dtype == want
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(singles.float(), ref if want == torch.float32
                               else ref.to(want).float(), **_tol(want))
    for m in (3, 16, 17, 40):  # one tile, a full tile, a tile plus one row, several tiles
        out = invariant_linear(x[:m], w, bias, out_dtype)
        assert out.shape == (m, n) and out.dtype == want and out.device == x.device
        for r in range(m):
            assert torch.equal(out[r], singles[r]), f"M={m} row {r} differs from M=1"
    # Rows at other offsets within a tile: x[5:22] puts row 5 at tile position 0.
    out = invariant_linear(x[5:22], w, bias, out_dtype)
    assert torch.equal(out, singles[5:22])


@torch.no_grad()
def test_leading_dims_and_strided_rows(dev: torch.device) -> None:
    x, w, b = _data(24, 48, 64, torch.float32, dev)
    out = invariant_linear(x.view(2, 12, 64), w, b)
    assert out.shape == (2, 12, 48)
    torch.testing.assert_close(out.view(24, 48), F.linear(x, w, b), **_tol(torch.float32))
    wide = torch.zeros(24, 80, device=dev)
    wide[:, :64] = x
    assert torch.equal(invariant_linear(wide[:, :64], w, b), out.view(24, 48))
    assert invariant_linear(x[:0], w).shape == (0, 48)


def test_errors(dev: torch.device) -> None:
    x, w, _ = _data(4, 48, 64, torch.float32, dev)
    with pytest.raises(ValueError, match="expected x"):
        invariant_linear(x[:, :32], w)
    with pytest.raises(ValueError, match="out_dtype"):
        invariant_linear(x, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="K % 8"):
        invariant_linear(x[:, :60], w[:, :60].contiguous())
