"""Triton skinny GEMM ``skinny_linear`` / ``linear`` vs ``F.linear``, and the dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from structspec.kernels import gemv  # noqa: E402
from structspec.kernels.gemv import MAX_ROWS, Config, linear, skinny_linear  # noqa: E402
from tests.kernels.conftest import dtypes  # noqa: E402


def _tol(dtype: torch.dtype, k: int) -> dict[str, float]:
    """Only the summation order differs from cuBLAS / MKL (both accumulate in float32); the
    float32 error grows with ``K``, bf16/fp16 outputs differ by at most ~1 ulp of rounding."""
    if dtype == torch.float32:
        return dict(atol=1e-5 * max(1.0, k / 256), rtol=1e-4)
    return dict(atol=2e-2, rtol=2e-2)


def _data(m: int, n: int, k: int, dtype: torch.dtype, dev: torch.device, bias: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
    return x, w, b


SHAPES = [(1000, 264), (64, 64), (96, 520), (257, 1024)]
CUDA_SHAPES = [(6144, 4096), (4096, 14336), (32000, 512)]


@pytest.mark.parametrize("dtype", dtypes() + ([torch.float16] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("nk", SHAPES + (CUDA_SHAPES if torch.cuda.is_available() else []))
@torch.no_grad()
def test_skinny_linear_matches_f_linear(dev: torch.device, dtype: torch.dtype, m: int,
                                        nk: tuple[int, int]) -> None:
    n, k = nk
    x, w, _ = _data(m, n, k, dtype, dev)
    out = skinny_linear(x, w)
    assert out.shape == (m, n) and out.dtype == dtype and out.device == x.device
    ref = F.linear(x.float(), w.float()).to(dtype)  # float32 accumulation, one rounding
    torch.testing.assert_close(out, ref, **_tol(dtype, k))


@pytest.mark.parametrize("config", [Config(16, 64, split_k=3), Config(32, 128, split_k=2),
                                    Config(64, 32, split_k=1), Config(16, 128, split_k=64)])
@pytest.mark.parametrize("m", [1, 5])
@torch.no_grad()
def test_forced_configs_and_split_k(dev: torch.device, config: Config, m: int) -> None:
    """Split-K (incl. more splits than K tiles), other tiles, K not a multiple of BLOCK_K."""
    x, w, b = _data(m, 200, 264, torch.float32, dev, bias=True)
    out = skinny_linear(x, w, b, config=config)
    torch.testing.assert_close(out, F.linear(x, w, b), **_tol(torch.float32, 264))


@pytest.mark.parametrize("m", [1, 4])
@torch.no_grad()
def test_bias_and_heuristic_split(dev: torch.device, m: int) -> None:
    """N small enough that the table splits K (on 132 SMs); bias added after the reduction."""
    x, w, b = _data(m, 24, 4096, torch.float32, dev, bias=True)
    cfg = gemv._config(m, 24, 4096, 132, itemsize=4)
    assert cfg.split_k > 1
    torch.testing.assert_close(skinny_linear(x, w, b, config=cfg), F.linear(x, w, b),
                               **_tol(torch.float32, 4096))


@torch.no_grad()
def test_strided_rows_and_empty(dev: torch.device) -> None:
    x, w, _ = _data(3, 40, 128, torch.float32, dev)
    wide = torch.zeros(3, 200, device=dev)
    wide[:, 8:136] = x
    xs = wide[:, 8:136]  # row stride 200, 16-byte aligned start
    torch.testing.assert_close(skinny_linear(xs, w), F.linear(x, w), **_tol(torch.float32, 128))
    assert skinny_linear(torch.empty(0, 128, device=dev), w).shape == (0, 40)


@torch.no_grad()
def test_linear_reshapes_leading_dims(dev: torch.device) -> None:
    x, w, b = _data(6, 72, 64, torch.float32, dev, bias=True)
    x3 = x.view(2, 3, 64)
    assert gemv.use_kernel(x3, w, b) == gemv.ENABLED
    out = linear(x3, w, b)
    assert out.shape == (2, 3, 72)
    torch.testing.assert_close(out, F.linear(x3, w, b), **_tol(torch.float32, 64))


@torch.no_grad()
def test_fallback_dispatch(dev: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cases ``linear`` hands to ``F.linear``: its result exactly."""
    monkeypatch.setattr(gemv, "ENABLED", True)
    _, w, _ = _data(1, 48, 64, torch.float32, dev)
    big = torch.randn(MAX_ROWS + 1, 64, device=dev)
    assert not gemv.use_kernel(big, w)
    assert torch.equal(linear(big, w), F.linear(big, w))
    assert not gemv.use_kernel(torch.randn(2, 60, device=dev), torch.randn(8, 60, device=dev))
    wt = torch.randn(64, 48, device=dev).t()  # non-contiguous weight
    x = torch.randn(2, 64, device=dev)
    assert not gemv.use_kernel(x, wt)
    assert torch.equal(linear(x, wt), F.linear(x, wt))
    assert not gemv.use_kernel(x.double(), w.double())
    assert not gemv.use_kernel(x, w, torch.randn(47, device=dev))
    with torch.enable_grad():
        wg = w.clone().requires_grad_(True)
        assert not gemv.use_kernel(x, wg)
        linear(x, wg).sum().backward()  # autograd still works through F.linear
        assert wg.grad is not None
    assert gemv.use_kernel(x, w)
    monkeypatch.setattr(gemv, "ENABLED", False)
    assert not gemv.use_kernel(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_cpu_without_interpreter_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "ENABLED", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(2, 64), torch.randn(48, 64)
    assert not gemv.use_kernel(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False),
                                                 ("off", False), ("false", False)])
def test_env_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv("STRUCTSPEC_GEMV", raising=False)
    else:
        monkeypatch.setenv("STRUCTSPEC_GEMV", value)
    assert gemv._env_enabled() is enabled


def test_errors(dev: torch.device) -> None:
    w = torch.randn(8, 64, device=dev)
    with pytest.raises(ValueError, match="MAX_ROWS"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 64, device=dev), w)
    with pytest.raises(ValueError, match="K % 8"):
        skinny_linear(torch.randn(2, 60, device=dev), torch.randn(8, 60, device=dev))
    with pytest.raises(ValueError, match="expected"):
        skinny_linear(torch.randn(2, 32, device=dev), w)
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(torch.randn(2, 64, device=dev).double(), w.double())


def test_config_table_is_deterministic() -> None:
    """Same shapes, same config; the Llama-3-8B decode shapes need no split on 132 SMs."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for m in (1, 8, 16):
            c = gemv._config(m, n, k, 132)
            assert c == gemv._config(m, n, k, 132) and c.split_k == 1
            assert n % c.block_n == 0 and k % c.block_k == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")
@torch.no_grad()
def test_cuda_graph_capture() -> None:
    from tests.graph_check import assert_no_sync_and_graph_replay

    dev = torch.device("cuda")
    x, w, _ = _data(4, 4096, 1024, torch.bfloat16, dev)
    xs, ws, _ = _data(1, 64, 4096, torch.bfloat16, dev)  # split-K path
    expected = torch.cat([skinny_linear(x, w).flatten(), skinny_linear(xs, ws).flatten()])
    assert_no_sync_and_graph_replay(
        lambda: torch.cat([skinny_linear(x, w).flatten(), skinny_linear(xs, ws).flatten()]),
        expected)


@pytest.mark.parametrize("m", [2, 3])
@torch.no_grad()
def test_fma_path_several_rows(dev: torch.device, m: int) -> None:
    x, w, b = _data(m, 100, 264, torch.float32, dev, bias=True)
    out = skinny_linear(x, w, b, config=Config(4, 128, use_dot=False))
    torch.testing.assert_close(out, F.linear(x, w, b), **_tol(torch.float32, 264))


@pytest.mark.parametrize("m", [1, 8, 16, 40])
@pytest.mark.parametrize("split", [False, True])
@torch.no_grad()
def test_float32_output_is_the_unrounded_accumulator(dev: torch.device, m: int,
                                                     split: bool) -> None:
    """``out_dtype=float32`` (the LM head): float32 results from 16-bit inputs equal the
    float32 reference to float32 summation-order error, far inside one bf16 step; ``m = 40``
    goes through the cuBLAS fallback (``linear_fp32_out``)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, k = (64, 4096) if split else (1000, 264)
    x, w, _ = _data(m, n, k, dtype, dev)
    out = linear(x, w, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(out, ref, **_tol(torch.float32, k))
    if dtype == torch.bfloat16:  # the bf16 result is coarser: rounding really is skipped
        assert (linear(x, w).float() - ref).abs().max() > (out - ref).abs().max()


@torch.no_grad()
def test_out_dtype_rejected(dev: torch.device) -> None:
    x, w, _ = _data(2, 64, 64, torch.float32, dev)
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(x, w, out_dtype=torch.int32)


def test_reduced_lm_head_on_the_gemv_kernel_matches_torch(dev: torch.device) -> None:
    """The EAGLE draft vocabulary's projection on the skinny GEMV (``set_kernels("triton")``,
    float32 out in one launch) equals its torch path."""
    from structspec.speculative.draft_vocab import ReducedLmHead

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 64, generator=g)
    ids = torch.tensor([0, 7, 64, 299, 5, 11, 12, 13])
    x = torch.randn(3, 2, 64, generator=g)
    head = ReducedLmHead(weight.to(dev), ids, packed_fp16=False)
    ref = head(x.to(dev))
    head.set_kernels("triton")
    got = head(x.to(dev))
    assert got.dtype == torch.float32 and got.shape == (3, 2, 8)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
