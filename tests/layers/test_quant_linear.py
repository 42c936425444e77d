"""Weight-only int8 / int4 / fp16 CPU linears (structspec/layers/quant_linear.py)."""

from __future__ import annotations

import pytest
import torch

from structspec.layers.quant_linear import (
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)


def _weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("make", [
    lambda w: Int8Linear.from_float(w),
    lambda w: Int4Linear.from_float(w, group_size=32),
    lambda w: Int4Linear.from_float(w, group_size=64),
    lambda w: Fp16Linear.from_float(w),
], ids=["int8", "int4-g32", "int4-g64", "fp16"])
def test_rows_do_not_depend_on_the_row_count(make, request: pytest.FixtureRequest) -> None:
    """Speculation's lossless property needs a token's logits to be the same in a 1-row
    decode and a many-row verify: every row must be bitwise the same whatever M is."""
    w = _weight()
    layer = make(w)
    if isinstance(layer, Fp16Linear) and torch.backends.cpu.get_cpu_capability() != "AVX512":
        # FBGEMM's AVX2 fp16 micro-kernel blocks rows (measured on an AVX2-only EPYC: a
        # 1-row call differs from every row of a 40-row call in the last bits): the
        # quantized CPU default is not bit-lossless there (README: invariant 2 is a float32
        # promise); the float32 lossless tests are unaffected
        request.applymarker(pytest.mark.xfail(reason="FBGEMM fp16 on AVX2 blocks rows",
                                              strict=False))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    full = layer(x)
    for m in (1, 2, 3, 5, 8, 13, 17):
        for start in (0, 3):
            assert torch.equal(layer(x[start:start + m]), full[start:start + m]), (m, start)
    assert layer(x.view(5, 8, 128)).shape == (5, 8, 96)
    rel = ((full - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert rel < 0.1, rel


def test_int8_quantization_is_symmetric_per_row() -> None:
    w = _weight()
    w[3] = 0.0  # an all-zero row gets scale 1, not a division by zero
    q, scales = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert scales[3] == 1.0 and not q[3].any()
    assert (q.float() * scales[:, None] - w).abs().max() <= scales.max() / 2 + 1e-7


def test_int4_groups_recover_q4_1_blocks_exactly() -> None:
    """A GGUF Q4_1 block is ``q * d + m`` with q in 0..15: quantizing its dequantized values
    with the block's min/max recovers ``q`` exactly (why int4 uses groups of 32)."""
    g = torch.Generator().manual_seed(2)
    n, k = 8, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    q[:, ::32] = 0
    q[:, 1::32] = 15  # every block spans 0..15, as Q4_1's min/max quantizer makes it
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.rand(n, k // 32, generator=g) * -0.05).half().float()
    w = (q.view(n, -1, 32).float() * d[..., None] + m[..., None]).view(n, k)
    got, scales, zeros = quantize_int4_groupwise(w, 32)
    assert torch.equal(got, q)
    torch.testing.assert_close(scales, d)
    torch.testing.assert_close(zeros, m + 8 * d)


def test_int4_group_size_errors_name_the_size() -> None:
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4_groupwise(_weight(), 48)
    with pytest.raises(ValueError, match="does not divide the 96 input channels"):
        quantize_int4_groupwise(_weight(8, 96), 64)


def test_bias_is_added_after_the_kernel() -> None:
    w, b = _weight(), torch.randn(96)
    x = torch.randn(4, 128)
    for make in (lambda bias: Int8Linear.from_float(w, bias),
                 lambda bias: Int4Linear.from_float(w, bias, group_size=32),
                 lambda bias: Fp16Linear.from_float(w, bias)):
        assert torch.equal(make(b)(x), make(None)(x) + b)
