"""Triton token-bitmask kernel vs the torch reference :func:`apply_bitmask_` (on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from structspec.kernels.bitmask import apply_token_bitmask_inplace  # noqa: E402

try:  # structspec.grammar imports xgrammar; a GPU box may lack it
    from structspec.grammar.bitmask import apply_bitmask_
except ImportError:
    apply_bitmask_ = None


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token t of row r survives iff bit t % 32 of word t // 32 is set (t < 32 * W)."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= bitmask.shape[1] or not (int(bitmask[r, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,width", [(100, 4), (100, 3), (700, 22), (1000, 32), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_matches_reference(dev: torch.device, vocab: int, width: int, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("the interpreter has no bfloat16")
    g = torch.Generator().manual_seed(vocab + width)
    rows = 5
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, width), generator=g, dtype=torch.int64)
    bm = bm.to(torch.int32)
    bm[0] = -1  # unconstrained row
    bm[1] = 0  # nothing allowed
    ref = _reference(logits, bm)
    out = apply_token_bitmask_inplace(logits.to(dev), bm.to(dev))
    assert torch.equal(out.cpu(), ref)
    if apply_bitmask_ is not None:
        assert torch.equal(apply_bitmask_(logits.clone(), bm), ref)  # CPU: torch reference
        # on CUDA the public entry point dispatches to the kernel
        assert torch.equal(apply_bitmask_(logits.to(dev), bm.to(dev)).cpu(), ref)


@torch.no_grad()
def test_strided_rows(dev: torch.device) -> None:
    """A row slice of a wider buffer (unit stride on the vocabulary) is masked in place."""
    vocab = 70
    buf = torch.randn(4, 96, device=dev)
    logits = buf[:, :vocab]
    bm = torch.zeros(4, 3, dtype=torch.int32, device=dev)
    bm[:, 0] = 0b101
    apply_token_bitmask_inplace(logits, bm)
    finite = torch.isfinite(buf[:, :vocab])
    assert finite[:, 0].all() and finite[:, 2].all() and finite.sum() == 8
    assert torch.isfinite(buf[:, vocab:]).all()  # past the view: untouched


def test_rejects_bad_shapes(dev: torch.device) -> None:
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(3, 70, device=dev),
                                    torch.zeros(2, 3, dtype=torch.int32, device=dev))
