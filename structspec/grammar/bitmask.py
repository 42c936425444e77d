"""Token bitmasks: allocation (pinned host memory, :func:`structspec.staging.pinned_full`) and
in-place application to logits.

Layout (xgrammar's): ``int32 [rows, W]`` with ``W = ceil(vocab_size / 32)``; token ``t`` is
allowed in a row when bit ``t % 32`` of word ``t // 32`` is set. ``-1`` (all bits) = no
constraint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from structspec.staging import pinned_full

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    """``ceil(vocab_size / 32)``, the number of int32 words per row."""
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin: bool) -> torch.Tensor:
    """A fresh host bitmask with every token allowed.

    The in-process mask build calls it once per verify step (a fresh page-locked buffer each
    time, which keeps the upload free of overwrite hazards; see
    :func:`~structspec.staging.pinned_full` for what the allocation costs).

    Args:
        rows: number of rows (e.g. ``bs * tree_size``).
        vocab_size: the logits width (which may exceed the tokenizer's size).
        pin: allocate in page-locked memory when CUDA is available, so that the upload
            (:func:`~structspec.staging.upload_pinned`) is truly asynchronous (a pageable
            source makes CUDA stage the copy and block the host).

    Returns:
        ``int32 [rows, ceil(vocab_size / 32)]`` on the CPU, filled with -1.
    """
    return pinned_full((rows, bitmask_width(vocab_size)), -1, torch.int32, pin=pin)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of forbidden tokens to ``-inf``, in place, with no host synchronisation.

    On CUDA with triton installed it runs one fused kernel
    (:func:`structspec.kernels.bitmask.apply_token_bitmask_inplace`); otherwise pure torch
    (shifts and a ``masked_fill_``), the reference, which runs on the CPU and on CUDA. Both can
    be captured in a CUDA graph.

    Args:
        logits: ``float [R, V]`` (any float dtype), on the same device as ``bitmask``.
        bitmask: ``int32 [R, W]``. Columns ``>= 32 * W`` of ``logits`` (padding beyond the
            grammar's vocabulary) are set to ``-inf`` as well: no grammar ever allows them.

    Returns:
        ``logits`` (modified in place).

    Raises:
        ValueError: on a row-count or device mismatch.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} "
                         "must be [R, V] and [R, W]")
    if logits.device != bitmask.device:
        raise ValueError(f"logits on {logits.device} but bitmask on {bitmask.device}")
    if logits.is_cuda and bitmask.dtype == torch.int32 and logits.stride(-1) == 1:
        fused = _fused_kernel()
        if fused is not None:
            return fused(logits, bitmask)
    return apply_bitmask_reference_(logits, bitmask)


def apply_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The pure-torch body of :func:`apply_bitmask_` (any device; no validation, no dispatch).

    ``logits [R, V]`` float and ``bitmask [R, W]`` int32 on one device; returns ``logits``.
    """
    rows, vocab = logits.shape
    width = bitmask.shape[1]
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS.setdefault(
            bitmask.device, torch.arange(32, dtype=torch.int32, device=bitmask.device))
    covered = min(vocab, 32 * width)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, 32 * width)[:, :covered]
    logits[:, :covered].masked_fill_(allowed == 0, float("-inf"))
    if vocab > covered:
        logits[:, covered:] = float("-inf")
    return logits


@functools.cache
def _fused_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The Triton bitmask kernel, or None when triton is not installed (imported once)."""
    from structspec.kernels import triton_available

    if not triton_available():
        return None
    from structspec.kernels.bitmask import apply_token_bitmask_inplace

    return apply_token_bitmask_inplace
