"""Fused Triton kernels for the CUDA forward (one job per module).

* :mod:`.norm` - RMSNorm and fused residual-add + RMSNorm.
* :mod:`.rotary` - rotary on q/k plus the K/V store into the pool, in one kernel.
* :mod:`.activation` - SwiGLU ``silu(gate) * up``.
* :mod:`.attention` - :class:`~structspec.kernels.attention.TritonAttentionBackend`, masked
  paged attention (prefill, decode, tree verify) with an optional split-KV reduce.
* :mod:`.bitmask` - grammar token-bitmask application to logits.
* :mod:`.gemv` - skinny GEMM / GEMV for forwards of at most 16 rows (decode, small verify),
  and its batch-invariant variant for any row count (``EngineConfig.batch_invariant``).
* :mod:`.draft_tree` - the EAGLE-2 expansion steps, node selection and verify-tree layout.
* :mod:`.paging` - page-table slot lookups and the draft frontier's attention mask.

The last two are *index kernels*: integer and comparison work that torch spreads over many
tiny launches, equal to the torch ops element for element. :func:`index_kernels_usable` says
where they run (``STRUCTSPEC_INDEX_KERNELS=0`` turns them off, for A/B runs).

Importing this package does not import triton; the submodules do. The torch reference ops in
:mod:`structspec.layers` remain the CPU path and the numerical reference. Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (Triton's interpreter; tests only).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from structspec.env_flags import env_flag


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works (CPU builds of torch usually come without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def sm_count(device: Any) -> int:
    """Streaming multiprocessors of ``device`` (a ``torch.device``; host-side query, no sync);
    16 off CUDA (the interpreter), so grid heuristics stay deterministic there."""
    if device.type != "cuda":
        return 16
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``); Triton block sizes must be powers of two."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def tree_row_tiles(n: int, max_nodes: int) -> tuple[int, int]:
    """Tile width ``N_PAD`` and warp count of a kernel that lays out one ``n``-node tree per
    program (:mod:`.draft_tree`'s layout).

    Raises:
        ValueError: ``n`` outside ``1..max_nodes``.
    """
    if not 1 <= n <= max_nodes:
        raise ValueError(f"tree of {n} nodes: expected 1..{max_nodes}")
    n_pad = next_pow2(n)
    return n_pad, 4 if n_pad <= 32 else 8


def _index_kernels_env() -> bool:
    """``STRUCTSPEC_INDEX_KERNELS`` unset or anything but ``0`` / ``false`` / ``off`` / ``no``."""
    return env_flag("STRUCTSPEC_INDEX_KERNELS")


INDEX_KERNELS = _index_kernels_env()
"""Whether the index kernels may run (read at call time; tests and A/B runs flip it)."""


def index_kernels_usable(x: Any) -> bool:
    """Whether the index kernels (:mod:`.draft_tree`, :mod:`.paging`) run on tensor ``x``'s
    device: :data:`INDEX_KERNELS`, triton installed, and CUDA, or the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``: tests and ``benchmarks/propose_launches.py``)."""
    if not INDEX_KERNELS or not triton_available():
        return False
    if x.device.type == "cuda":
        return True
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
