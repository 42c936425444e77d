"""Grammar token bitmask applied to logits in one Triton kernel.

Same semantics as the torch reference :func:`structspec.grammar.bitmask.apply_bitmask_`
(which dispatches here for CUDA tensors): token ``t`` of row ``r`` keeps its logit when bit
``t % 32`` of ``bitmask[r, t // 32]`` is set, else becomes ``-inf``; columns ``>= 32 * W``
(padding beyond the grammar's vocabulary) always become ``-inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _bitmask_kernel(Logits, Mask, vocab, width, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    words = tl.load(Mask + row * stride_m + cols // 32, mask=in_vocab & (cols < 32 * width),
                    other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    # Only forbidden entries are written: allowed logits are never touched.
    tl.store(Logits + row * stride_l + cols, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set forbidden logits to ``-inf`` in place (no host sync; capturable).

    Args:
        logits: ``[R, V]`` float (any float dtype, unit stride on ``V``), CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        bitmask: ``[R, W]`` int32 on the same device.

    Returns:
        ``logits``.

    Raises:
        ValueError: shapes, dtype or devices do not fit.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} "
                         "must be [R, V] and [R, W]")
    if bitmask.dtype != torch.int32 or logits.device != bitmask.device:
        raise ValueError("bitmask must be int32 on the logits' device")
    if logits.stride(-1) != 1:
        raise ValueError("logits must have unit stride on the vocabulary axis")
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    rows, vocab = logits.shape
    if rows and vocab:
        grid = (rows, triton.cdiv(vocab, _BLOCK))
        _bitmask_kernel[grid](logits, bitmask, vocab, bitmask.shape[1], logits.stride(0),
                              bitmask.stride(0), BLOCK=_BLOCK, num_warps=4)
    return logits
