"""Kernel tests: on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

Each test module starts with ``pytest.importorskip("triton")`` (CI has no triton: the module
is skipped); the ``dev`` fixture skips when there is neither a GPU nor the interpreter.
Interpreter runs use float32 only (numpy has no bfloat16) and small shapes.
"""

from __future__ import annotations

import os

import pytest
import torch


def kernel_device() -> torch.device | None:
    """Where the Triton kernels can run here, or None."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    return None


@pytest.fixture
def dev() -> torch.device:
    """The kernel device (skips the test when there is none)."""
    d = kernel_device()
    if d is None:
        pytest.skip("Triton kernels need CUDA, or TRITON_INTERPRET=1 for the CPU interpreter")
    return d


def dtypes() -> list[torch.dtype]:
    """float32 everywhere; bfloat16 too on CUDA (the interpreter has no bfloat16)."""
    return [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]


def tol(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances of a fused kernel vs the torch reference in ``dtype``."""
    if dtype == torch.float32:
        return dict(atol=2e-5, rtol=2e-5)
    return dict(atol=3e-2, rtol=3e-2)
