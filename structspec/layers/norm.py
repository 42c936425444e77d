"""RMSNorm, numerically identical to Hugging Face's Llama/Qwen implementation."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    The variance is computed in float32 and the normalised activations are cast back to the
    input dtype *before* the weight multiply, exactly as ``LlamaRMSNorm`` does, so fp32 outputs
    match HF bit for bit and bf16 outputs round the same way.

    Args:
        hidden_size: size of the last dimension (``H``, or ``head_dim`` for Qwen3's q/k norm).
        eps: added to the variance.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` ``[..., hidden_size]`` (any float dtype/device); same shape/dtype out."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
